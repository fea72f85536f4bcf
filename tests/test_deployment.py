"""``omnilab.deployment``: how ``from_pretrained``'s deploy arguments become the applied profile and placement.

No vLLM engine is built here (``prepare`` is plain policy); the eager pipeline checks that the profile's
threads, dtype and chunking are what the stages run with.
"""
from __future__ import annotations

import pytest
from conftest import clear_override_env
import torch

from omnilab.deployment import prepare
from omnilab.errors import ConfigError, InputError, WorkerError
from omnilab.profiles import DeployProfile, plan
from omnilab.profiles.planner import as_geometry

TEXT = "Threads where the stage runs."
KW = dict(speaker="vivian", language="english", do_sample=False, subtalker_do_sample=False, max_new_tokens=5)


@pytest.fixture(autouse=True)
def _no_profile_env(monkeypatch):
    clear_override_env(monkeypatch)


@pytest.mark.parametrize("machine, mode", [("vm2_avx2", "shared"), ("xeon_2s_avx512_smt", "split")])
def test_auto_profile_places_the_engine_by_the_planned_mode(tiny_ckpt, monkeypatch, machine, mode):
    """``deploy=None`` on an auto profile: in this process when the plan shares CPUs (2-core VM), stage workers
    on the planned CPUs when it splits them (2-socket Xeon). The profile is planned on a hardware fixture, not
    on the host running the suite, so both outcomes are checked on every machine."""
    import os
    from pathlib import Path

    from omnilab.hardware import probe_hardware

    hw = probe_hardware(Path(__file__).resolve().parent / "fixtures" / "hardware" / f"{machine}.json")
    monkeypatch.setattr("omnilab.profiles.resolve.probe_hardware", lambda *a, **k: hw)  # what resolve_profile probes
    for k in [k for k in os.environ if k.startswith("VLLM_CPU_")]:  # vLLM's CPU variables would override the plan
        monkeypatch.delenv(k)
    if mode == "split":
        # the tiny checkpoint runs far under real time on 56 cores, where the planner keeps one process
        easy = prepare(tiny_ckpt(), backend="vllm")
        assert easy.profile.mode.value == "shared" and "far under real time" in easy.profile.mode.reason
        assert easy.placement == "in-process"
        monkeypatch.setattr("omnilab.profiles.planner.EASY_SHARE", 0.0)  # the 0.6B-like case: a split pays
    d = prepare(tiny_ckpt(), backend="vllm")
    p = d.profile
    assert isinstance(p, DeployProfile) and p.name == "auto" and p.mode.value == mode and p.mode.source == "auto"
    t = d.vllm_deploy.talker
    if mode == "shared":
        assert d.placement == "in-process" and "shared" in d.reason and t.multiprocess is False
        assert d.num_threads == p.threads("talker") and not d.vllm_deploy.code2wav_process
    else:
        assert d.placement == "workers" and "split" in d.reason and d.num_threads is None
        assert t.multiprocess and t.talker_cpus == p.cpus("talker") and t.talker_threads == p.threads("talker")
        assert d.vllm_deploy.code2wav_process and d.vllm_deploy.code2wav_cpus == p.cpus("code2wav")
        assert not set(p.cpus("talker")) & set(p.cpus("code2wav"))
    assert t.kv_cache_memory_bytes == p.kv_cache_bytes.value
    assert t.max_num_seqs == p.max_num_seqs.value
    assert d.dtype == p.dtype.value and p.dtype.source == "auto"
    assert d.dtype == ("bfloat16" if hw.native_bf16()[0] else "float32")
    c = d.chunk_schedule
    assert (c.first_frames, c.ramp, c.steady_frames) == (p.first_chunk_frames.value, p.chunk_ramp_frames.value,
                                                         p.steady_chunk_frames.value)


def test_split_profile_puts_stages_in_workers_on_the_planned_cpus(tiny_ckpt, monkeypatch):
    monkeypatch.setenv("OMNILAB_STAGE_MODE", "split")
    d = prepare(tiny_ckpt(), backend="vllm")
    p = d.profile
    assert p.mode.value == "split" and p.mode.source == "env OMNILAB_STAGE_MODE"
    assert d.placement == "workers" and d.num_threads is None  # this process's threads are left alone
    t = d.vllm_deploy.talker
    assert t.multiprocess and t.talker_cpus == p.cpus("talker") and t.talker_threads == p.threads("talker")
    assert d.vllm_deploy.code2wav_process and d.vllm_deploy.code2wav_cpus == p.cpus("code2wav")


def test_multiprocess_is_an_alias_of_workers(tiny_ckpt):
    a, b = prepare(tiny_ckpt(), backend="vllm", deploy="workers"), prepare(tiny_ckpt(), backend="vllm",
                                                                        deploy="multiprocess")
    assert a.placement == b.placement == "workers" and a.vllm_deploy == b.vllm_deploy


def test_explicit_arguments_replan_as_argument_overrides(tiny_ckpt):
    d = prepare(tiny_ckpt(), backend="vllm", dtype="fp32", num_threads=1, max_concurrency=3, deploy="workers")
    p = d.profile
    assert p.dtype.value == "float32" and p.dtype.source == "argument"
    assert p.talker_threads.value == 1 and p.talker_threads.source == "argument" and len(p.cpus("talker")) == 1
    assert p.max_num_seqs.value == 3
    # the KV budget is planned for the requested dtype and concurrency
    kv_fp32 = plan(model_config=as_geometry(tiny_ckpt()), max_concurrency=3, overrides={"dtype": "float32"})
    assert p.kv_cache_bytes.value == kv_fp32.kv_cache_bytes.value
    assert d.placement == "workers" and "deploy='workers'" in d.reason


def test_eager_backend_applies_threads_and_chunking(tiny_ckpt):
    from omnilab.pipeline import Pipeline

    before = torch.get_num_threads()
    try:
        with Pipeline.from_pretrained(tiny_ckpt(), backend="eager", num_threads=1, dtype="float32") as pipe:
            assert pipe.profile.threads("talker") == 1 and torch.get_num_threads() == 1
            assert pipe.model.dtype == torch.float32 and pipe.profile.dtype.value == "float32"
            assert pipe.chunk_schedule.steady_frames == pipe.profile.steady_chunk_frames.value
            assert pipe.deployment.placement == "in-process"
            got = pipe.check_profile()
            assert (got["talker"], got["code2wav"]) == (1, 1)
            assert set(got["not_applied"]) == {name for name, _ in pipe.deployment.not_applied}
            torch.set_num_threads(2)
            with pytest.raises(WorkerError, match="talker runs in this process with 2 torch threads; the profile "
                                                  "says 1"):
                pipe.check_profile()
    finally:
        torch.set_num_threads(before)


def _shared_profile(**overrides):
    from omnilab.hardware import probe_hardware
    from pathlib import Path

    hw = probe_hardware(Path(__file__).parent / "fixtures" / "hardware" / "vm2_avx2.json")
    return plan(hw, env={}, overrides={"mode": "shared", **overrides})


def test_in_process_profile_says_what_runs():
    """In this process the stages take turns on the talker's threads: an automatic code2wav plan (1 thread on
    one talker CPU, made for a code2wav process beside the talker) becomes the talker's threads, with the
    reason; explicit values stay; CPU pinning and LD_PRELOAD, which a running process cannot take, are listed
    as not applied."""
    from omnilab.deployment import fit_in_process

    p = _shared_profile(preload="/usr/lib/libfake.so")
    assert (p.threads("talker"), p.threads("code2wav")) == (2, 1)
    fitted, not_applied = fit_in_process(p, affinity={0, 1})
    assert fitted.threads("code2wav") == 2 and fitted.cpus("code2wav") == p.cpus("talker")
    assert fitted.code2wav_threads.source == "placement" and "lock-step" in fitted.code2wav_threads.reason
    assert dict(not_applied).keys() == {"preload"} and "LD_PRELOAD" in dict(not_applied)["preload"]
    _, not_applied = fit_in_process(p, affinity={0, 1, 2, 3})
    assert {"talker_cpus", "code2wav_cpus", "preload"} == set(dict(not_applied))
    explicit = _shared_profile(code2wav_threads=1)
    fitted, _ = fit_in_process(explicit, affinity={0, 1})
    assert fitted.code2wav_threads == explicit.code2wav_threads  # the user's value is what runs


def test_an_automatic_split_layout_gives_the_in_process_talker_every_core():
    """A split layout (talker and code2wav on disjoint cores, planned for a code2wav process beside the talker, as
    the int4 plan on 2 cores was before splits paid for vLLM's engine core) would leave a core idle in this process,
    where the stages take turns: the talker gets both cores and code2wav its threads, with the reason. An explicit
    talker thread count stays as asked."""
    from omnilab.deployment import fit_in_process
    from omnilab.hardware import probe_hardware
    from pathlib import Path

    from omnilab.profiles.profile import Resolved

    hw = probe_hardware(Path(__file__).parent / "fixtures" / "hardware" / "vm2_avx2.json")
    # an automatic split of the 2-core fixture (talker on CPU 0, code2wav on CPU 1), every value planned ("auto"),
    # whichever layout the cost model prefers today
    auto = plan(hw, env={}, overrides={"quantization": "int4"})
    split = {"mode": "split", "talker_threads": 1, "talker_cpus": ((0,),), "code2wav_threads": 1,
             "code2wav_cpus": (1,)}
    p = auto.replace(**{k: Resolved(v, "a planned split", "auto") for k, v in split.items()})
    assert p.threads("talker") == 1 and p.mode.source == "auto"
    fitted, _ = fit_in_process(p, affinity={0, 1})
    assert fitted.threads("talker") == 2 and set(fitted.cpus("talker")) == {0, 1}
    assert fitted.threads("code2wav") == 2 and fitted.mode.value == "shared"
    assert fitted.talker_threads.source == "placement" and "lock-step" in fitted.talker_threads.reason
    explicit = p.replace(talker_threads=Resolved(1, "asked", "argument"))
    fitted, _ = fit_in_process(explicit, affinity={0, 1})
    assert fitted.threads("talker") == 1 and fitted.talker_threads == explicit.talker_threads


def test_in_process_code2wav_runs_on_the_profile_threads(tiny_ckpt, monkeypatch):
    """An explicit code2wav thread count is applied around every code2wav call in this process (and this
    process's count restored), and ``check_profile`` reads it back."""
    from omnilab.pipeline import Pipeline

    monkeypatch.setenv("OMNILAB_CODE2WAV_THREADS", "1")
    before = torch.get_num_threads()
    try:
        with Pipeline.from_pretrained(tiny_ckpt(), backend="eager", num_threads=2, dtype="float32",
                                      deploy_profile="vm-2core") as pipe:
            assert pipe.profile.threads("code2wav") == 1
            seen = []
            inner = pipe.code2wav.decoder.decode_chunk
            monkeypatch.setattr(pipe.code2wav.decoder, "decode_chunk",
                                lambda *a, **k: (seen.append(torch.get_num_threads()), inner(*a, **k))[1])
            inner_decode = pipe.code2wav.decoder.decode
            monkeypatch.setattr(pipe.code2wav.decoder, "decode",
                                lambda *a, **k: (seen.append(torch.get_num_threads()), inner_decode(*a, **k))[1])
            list(pipe.stream(TEXT, **KW))
            pipe.generate(TEXT, **KW)
            assert seen and set(seen) == {1} and torch.get_num_threads() == 2
            got = pipe.check_profile()
            assert (got["talker"], got["code2wav"]) == (2, 1)
    finally:
        torch.set_num_threads(before)


def test_no_profile_leaves_the_process_alone(tiny_ckpt):
    from omnilab.pipeline import Pipeline

    with Pipeline.from_pretrained(tiny_ckpt(), backend="eager", deploy_profile=None, dtype="float32") as pipe:
        assert pipe.profile is None and pipe.chunk_schedule.steady_frames == 25
        with pytest.raises(InputError, match="no deploy profile"):
            pipe.check_profile()


def test_bad_deploy_arguments_name_the_value(tiny_ckpt):
    ck = tiny_ckpt()
    with pytest.raises(InputError, match="deploy 'cluster'.*accepted: auto, inprocess, workers"):
        prepare(ck, backend="vllm", deploy="cluster")
    with pytest.raises(InputError, match="backend='vllm' only"):
        prepare(ck, backend="eager", deploy="workers")
    with pytest.raises(ConfigError, match="unknown deploy profile 'warp-drive'"):
        prepare(ck, backend="vllm", deploy_profile="warp-drive")
    with pytest.raises(InputError, match="deploy_profile 42"):
        prepare(ck, backend="vllm", deploy_profile=42)
    with pytest.raises(ConfigError, match=r"no CPU placement satisfies talker_threads=64 \(argument\)"):
        prepare(ck, backend="vllm", num_threads=64)
    with pytest.raises(InputError, match="num_threads must be a positive integer"):
        prepare(ck, backend="vllm", num_threads=0)
    with pytest.raises(InputError, match="needs deploy_profile"):
        prepare(ck, backend="vllm", deploy_profile=None, max_concurrency=2)
    profile = plan(model_config=as_geometry(ck), overrides={"talker_threads": 1})
    with pytest.raises(InputError, match="num_threads=2 contradicts"):
        prepare(ck, backend="vllm", deploy_profile=profile, num_threads=2)


def test_preset_and_yaml_profiles_apply(tiny_ckpt, tmp_path):
    d = prepare(tiny_ckpt(), backend="eager", deploy_profile="vm-2core")
    assert d.profile.name == "vm-2core" and d.dtype == "float32"
    path = tmp_path / "mine.yaml"
    d.profile.to_yaml(path)
    d2 = prepare(tiny_ckpt(), backend="eager", deploy_profile=str(path))
    assert d2.profile.values() == d.profile.values()
    d3 = prepare(tiny_ckpt(), backend="eager", deploy_profile=d.profile, dtype="bfloat16")
    assert d3.profile.dtype.value == "bfloat16" and d3.profile.dtype.source == "argument"


def test_an_explicit_deploy_is_resolved_once(tiny_ckpt):
    """``deploy=`` given explicitly (a dict here) becomes a ``VllmDeploy`` in ``prepare``; the stage builders
    (``client_load_options``, ``build_stages``) get that object back from ``resolve_deploy`` as is."""
    from omnilab.stages.vllm.deploy import VllmDeploy, client_load_options, resolve_deploy

    d = prepare(tiny_ckpt(), backend="vllm", deploy={"max_model_len": 256, "block_size": 32})
    assert d.placement == "custom" and isinstance(d.vllm_deploy, VllmDeploy)
    assert resolve_deploy(d.vllm_deploy) is d.vllm_deploy and d.vllm_deploy.talker.max_model_len == 256
    assert client_load_options(d.vllm_deploy) == {"load_talker": True, "load_code2wav": True}
