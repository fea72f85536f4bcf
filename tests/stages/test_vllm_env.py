"""vLLM's CPU variables reach the talker engine as vLLM reads them: nothing unset behind the user's back,
the config and the variables agree or the engine refuses to start, and two engines show the effect on a
running engine (KV blocks from ``VLLM_CPU_KVCACHE_SPACE``, the worker's CPU affinity from
``VLLM_CPU_OMP_THREADS_BIND``, the predictor compile flag from ``VLLM_OMNI_CPU_INDUCTOR``)."""
from __future__ import annotations

import os

import pytest

from _deps import need  # noqa: E402
from conftest import clear_override_env
import torch

from omnilab.errors import ConfigError, InputError, UnsupportedError
from omnilab.hardware import GiB
from omnilab.stages.vllm.config import VllmStageConfig, compile_predictor_flag, engine_cpu_env, engine_kv_bytes

VARS = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
        "VLLM_OMNI_CPU_INDUCTOR", "OMNILAB_CPU_INDUCTOR")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    clear_override_env(monkeypatch, VARS)


# ---------------------------------------------------------------- plain Python: what the engine is given
def test_kv_size_follows_vllm_cpu_kvcache_space():
    c = VllmStageConfig()
    assert engine_kv_bytes(c, 12345, {}) == 12345
    assert engine_kv_bytes(c, 12345, {"VLLM_CPU_KVCACHE_SPACE": "2"}) == 2 * GiB  # vLLM applies it over the arg
    assert engine_kv_bytes(c, 12345, {"VLLM_CPU_KVCACHE_SPACE": ""}) == 12345  # vLLM ignores an empty value
    fixed = VllmStageConfig(kv_cache_memory_bytes=2 * GiB)
    assert engine_kv_bytes(fixed, 1, {"VLLM_CPU_KVCACHE_SPACE": "2"}) == 2 * GiB
    with pytest.raises(ConfigError, match=r"kv_cache_memory_bytes=1073741824 \(1.00 GiB\) but "
                                          r"VLLM_CPU_KVCACHE_SPACE='3'"):
        engine_kv_bytes(VllmStageConfig(kv_cache_memory_bytes=GiB), 1, {"VLLM_CPU_KVCACHE_SPACE": "3"})
    with pytest.raises(ConfigError, match=r"VLLM_CPU_KVCACHE_SPACE='2.5': vLLM reads a whole number of GiB"):
        engine_kv_bytes(c, 1, {"VLLM_CPU_KVCACHE_SPACE": "2.5"})
    frac = VllmStageConfig(engine_kwargs={"gpu_memory_utilization": 0.4})  # vLLM sizes the cache itself
    assert engine_kv_bytes(frac, 12345, {}) is None


def test_gpu_memory_utilization_is_accepted_with_vllm_cpu_meaning():
    assert VllmStageConfig(engine_kwargs={"gpu_memory_utilization": 0.5}).engine_kwargs["gpu_memory_utilization"] == 0.5
    with pytest.raises(InputError, match=r"gpu_memory_utilization=1.5: expected a fraction in \(0, 1\]"):
        VllmStageConfig(engine_kwargs={"gpu_memory_utilization": 1.5})
    with pytest.raises(UnsupportedError, match="sleep mode"):  # GPU-only options are still refused
        VllmStageConfig(engine_kwargs={"enable_sleep_mode": True})


def test_bind_reaches_the_engine_and_must_agree():
    listed = VllmStageConfig(multiprocess=True, talker_cpus=(1,), talker_threads=1)
    assert engine_cpu_env(listed, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert engine_cpu_env(listed, {"VLLM_CPU_OMP_THREADS_BIND": "1"}) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert engine_cpu_env(listed, {"VLLM_CPU_OMP_THREADS_BIND": "auto"})["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    with pytest.raises(ConfigError, match=r"bind '1' but VLLM_CPU_OMP_THREADS_BIND='0' is set"):
        engine_cpu_env(listed, {"VLLM_CPU_OMP_THREADS_BIND": "0"})
    with pytest.raises(ConfigError, match=r"bind '1' but VLLM_CPU_OMP_THREADS_BIND='all'"):
        engine_cpu_env(listed, {"VLLM_CPU_OMP_THREADS_BIND": "all"})
    bare = VllmStageConfig(multiprocess=True)
    assert engine_cpu_env(bare, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "auto"}
    assert engine_cpu_env(bare, {"VLLM_CPU_OMP_THREADS_BIND": "0"}) == {}  # the environment's value stays
    with pytest.raises(ConfigError, match=r"'0\|1' gives 2 rank list\(s\) but the talker runs 1"):
        engine_cpu_env(bare, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})  # vLLM would assert on it at start
    assert engine_cpu_env(bare, {"VLLM_CPU_OMP_THREADS_BIND": "all"}) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    free = VllmStageConfig(multiprocess=True, pin_threads=False, talker_threads=2)
    assert engine_cpu_env(free, {"VLLM_CPU_OMP_THREADS_BIND": "all"}) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                                                         "OMP_NUM_THREADS": "2"}
    with pytest.raises(InputError, match="pin_threads=False"):
        VllmStageConfig(pin_threads=False, talker_cpus=(0,))
    counted = VllmStageConfig(multiprocess=True, reserved_cpus=1)
    assert engine_cpu_env(counted, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    with pytest.raises(ConfigError, match=r"reserved_cpus=1 but VLLM_CPU_NUM_OF_RESERVED_CPU='2'"):
        engine_cpu_env(counted, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"})
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in engine_cpu_env(bare, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"})


def test_unpinned_profile_becomes_a_nobind_engine():
    from omnilab.profiles import plan
    from omnilab.hardware import probe_hardware
    from omnilab.stages.vllm.deploy import VllmDeploy

    hw = probe_hardware(os.path.join(os.path.dirname(__file__), "..", "fixtures", "hardware", "vm2_avx2.json"))
    d = VllmDeploy.from_profile(plan(hw, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}))
    assert d.talker.pin_threads is False and d.talker.talker_cpus is None and d.talker.talker_threads == 2
    assert engine_cpu_env(d.talker, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"})["OMP_NUM_THREADS"] == "2"


def test_workers_without_a_profile_follow_the_bind_list():
    """``deploy="workers"`` with ``deploy_profile=None`` places the talker where ``VLLM_CPU_OMP_THREADS_BIND``
    says (instead of its own default list), code2wav on a CPU the talker does not use."""
    from omnilab.stages.vllm.deploy import VllmDeploy

    last = sorted(os.sched_getaffinity(0))[-1]
    d = VllmDeploy.multiprocess_default({"VLLM_CPU_OMP_THREADS_BIND": str(last)})
    assert d.talker.talker_cpus == (last,) and d.talker.talker_threads == 1
    assert d.code2wav_process and (len(os.sched_getaffinity(0)) == 1 or last not in d.code2wav_cpus)
    assert engine_cpu_env(d.talker, {"VLLM_CPU_OMP_THREADS_BIND": str(last)})["VLLM_CPU_OMP_THREADS_BIND"] == str(last)
    tp = VllmDeploy.multiprocess_default({"VLLM_CPU_OMP_THREADS_BIND": "0|1"})  # one rank per list
    assert tp.talker.tensor_parallel_size == 2 and tp.talker.rank_cpus == ((0,), (1,)) and tp.code2wav_cpus == (1,)
    with pytest.raises(InputError, match="equal length"):
        VllmDeploy.multiprocess_default({"VLLM_CPU_OMP_THREADS_BIND": "0|1-2"})


def _fixture(name: str):
    from omnilab.hardware import probe_hardware
    return probe_hardware(os.path.join(os.path.dirname(__file__), "..", "fixtures", "hardware", f"{name}.json"))


def _tiny():
    import json

    from omnilab.checkpoint.configs import config_json
    from omnilab.config import Qwen3TTSConfig
    return Qwen3TTSConfig.from_dict(json.loads(config_json("tiny", "custom_voice")))


@pytest.mark.parametrize("where", ["this machine", "split fixture", "nobind fixture"])
def test_workers_start_from_the_profiles_to_env_and_engine_args(where):
    """One road from a profile to the processes: the environment the talker engine's processes start with and
    the ``EngineArgs`` it is built with (the pure builders ``_build_engine`` calls, no engine started) carry
    every ``to_env("talker")`` value and every ``engine_args("talker")`` value they share; the code2wav worker
    gets ``to_env("code2wav")``."""
    from omnilab.hardware import probe_hardware
    from omnilab.profiles import plan
    from omnilab.stages.vllm.config import engine_env, engine_kwargs, kv_bytes_per_token
    from omnilab.stages.vllm.deploy import VllmDeploy

    cfg = _tiny()
    if where == "this machine":
        profile = plan(probe_hardware(), cfg, env={})  # the auto profile
    elif where == "split fixture":
        profile = plan(_fixture("xeon_2s_avx512_smt"), cfg, env={}, overrides={"mode": "split"})
        assert profile.mode.value == "split"
    else:
        profile = plan(_fixture("vm2_avx2"), cfg, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
        assert not profile.talker_pinned
    d = VllmDeploy.from_profile(profile)  # deploy="workers"
    env = engine_env(d.talker, {}, compile_predictor=False)
    want_env = profile.to_env("talker")
    assert {k: env.get(k) for k in want_env} == want_env
    assert env["SPT_NOENV"] == "1"  # vLLM's setproctitle keeps off the environment block /proc/<pid>/environ shows
    kwargs = engine_kwargs(d.talker, {}, model_dir="unused", dtype=profile.dtype.value,
                           per_token_bytes=kv_bytes_per_token(cfg, getattr(torch, profile.dtype.value)))
    args = profile.engine_args("talker")
    shared = args.keys() & kwargs.keys()
    assert {"dtype", "max_num_seqs", "max_model_len", "kv_cache_memory_bytes", "block_size", "enforce_eager",
            "enable_prefix_caching"} <= shared
    assert {k: kwargs[k] for k in shared} == {k: args[k] for k in shared}
    assert dict(d.code2wav_env) == profile.to_env("code2wav")
    assert (d.code2wav_cpus, d.code2wav_threads) == (profile.cpus("code2wav"), profile.threads("code2wav"))
    inproc = VllmDeploy.from_profile(profile, multiprocess=False)  # no process is started: nothing to set
    assert not inproc.talker.env and not inproc.code2wav_env
    assert engine_kwargs(inproc.talker, {}, model_dir="unused", dtype=profile.dtype.value, per_token_bytes=1)[
        "kv_cache_memory_bytes"] == args["kv_cache_memory_bytes"]


def test_an_engine_config_that_disagrees_with_its_process_env_is_refused():
    from omnilab.stages.vllm.config import engine_env, engine_kwargs

    bound = VllmStageConfig(multiprocess=True, talker_cpus=(1,), talker_threads=1,
                            env={"VLLM_CPU_OMP_THREADS_BIND": "2"})
    with pytest.raises(ConfigError, match=r"sets VLLM_CPU_OMP_THREADS_BIND='2' .* but the engine config gives '1'"):
        engine_env(bound, {}, compile_predictor=False)
    sized = VllmStageConfig(multiprocess=True, kv_cache_memory_bytes=GiB, env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    with pytest.raises(ConfigError, match="VLLM_CPU_KVCACHE_SPACE='2'"):
        engine_kwargs(sized, {}, model_dir="unused", dtype="float32", per_token_bytes=1)
    with pytest.raises(InputError, match="needs multiprocess=True"):
        VllmStageConfig(env={"OMP_NUM_THREADS": "1"})


@pytest.mark.vllm
def test_padded_head_sizes_are_the_installed_vllm_cpu_attentions():
    cpu_attn = need("vllm.v1.attention.backends.cpu_attn")
    from omnilab.profiles.cost import SUPPORTED_HEAD_SIZES
    assert tuple(cpu_attn.CPUAttentionBackend.get_supported_head_sizes()) == SUPPORTED_HEAD_SIZES


def test_predictor_compile_flag_reads_vllm_omni_inductor():
    assert compile_predictor_flag(None, {}) == (False, "default: off")
    omni = compile_predictor_flag(None, {"VLLM_OMNI_CPU_INDUCTOR": "1"})
    assert omni == (True, "env (vLLM-Omni) VLLM_OMNI_CPU_INDUCTOR")
    assert compile_predictor_flag(None, {"OMNILAB_CPU_INDUCTOR": "1"}) == (True, "env OMNILAB_CPU_INDUCTOR")
    assert compile_predictor_flag(None, {"OMNILAB_CPU_INDUCTOR": "on", "VLLM_OMNI_CPU_INDUCTOR": "1"})[0] is True
    assert compile_predictor_flag(False, {"VLLM_OMNI_CPU_INDUCTOR": "1"}) == (False, "argument compile_predictor")
    with pytest.raises(ConfigError, match=r"OMNILAB_CPU_INDUCTOR='0' and VLLM_OMNI_CPU_INDUCTOR='1' disagree"):
        compile_predictor_flag(None, {"OMNILAB_CPU_INDUCTOR": "0", "VLLM_OMNI_CPU_INDUCTOR": "1"})
    with pytest.raises(ConfigError, match=r"VLLM_OMNI_CPU_INDUCTOR='maybe': accepted values"):
        compile_predictor_flag(None, {"VLLM_OMNI_CPU_INDUCTOR": "maybe"})


# ---------------------------------------------------------------- running engines (tiny checkpoint)
def _kv_blocks(pipe, kv_bytes: int) -> tuple[int, int]:
    """(blocks the engine allocated, blocks ``kv_bytes`` hold at the talker's bytes per token)."""
    from omnilab.stages.vllm.config import kv_bytes_per_token

    engine = pipe._talker.engine
    cache = engine.vllm_config.cache_config
    per_block = kv_bytes_per_token(pipe.model.config, pipe.model.dtype) * cache.block_size
    return cache.num_gpu_blocks, kv_bytes // per_block


@pytest.mark.vllm
@pytest.mark.slow
def test_inprocess_engine_follows_kvcache_space_and_omni_inductor(tiny_ckpt, monkeypatch):
    need("vllm")
    import torch

    from omnilab.pipeline import Pipeline

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    monkeypatch.setenv("VLLM_OMNI_CPU_INDUCTOR", "1")
    before = torch.get_num_threads()
    try:
        with Pipeline.from_pretrained(tiny_ckpt(), dtype="float32", deploy="inprocess") as pipe:
            kv = pipe.profile.kv_cache_bytes
            assert kv.value == 2 * GiB and kv.source == "env (vLLM) VLLM_CPU_KVCACHE_SPACE"
            assert pipe._talker.config.kv_cache_memory_bytes == 2 * GiB
            got, want = _kv_blocks(pipe, 2 * GiB)
            assert got == want  # vLLM read the variable (still set) and agrees with the argument
            assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
            assert pipe._talker.compile_predictor == (True, "env (vLLM-Omni) VLLM_OMNI_CPU_INDUCTOR")
            assert pipe._talker.runner.compile_predictor is True  # the flag the runner compiles on (no step run)
    finally:
        torch.set_num_threads(before)


@pytest.mark.vllm
@pytest.mark.slow
def test_worker_engine_follows_threads_bind_and_kvcache_space(tiny_ckpt, monkeypatch):
    """Under deploy="workers", the talker worker's threads run on the CPU VLLM_CPU_OMP_THREADS_BIND names."""
    need("vllm")
    from omnilab.pipeline import Pipeline
    from omnilab.profiles.readback import read_process

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 usable CPUs")
    bind = str(cpus[-1])
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    with Pipeline.from_pretrained(tiny_ckpt(), dtype="float32", deploy="workers") as pipe:
        prof = pipe.profile
        assert prof.talker_cpus.value == ((cpus[-1],),)
        assert prof.talker_cpus.source == "env (vLLM) VLLM_CPU_OMP_THREADS_BIND" and prof.talker_threads.value == 1
        readback = pipe.check_profile()  # raises WorkerError listing any difference from the plan
        roles = {role: pid for pid, role in pipe.processes().items()}
        rb = read_process(roles["talker"])
        assert readback["talker"].pid == rb.pid
        assert {c for mask in rb.thread_cpus for c in mask} == {cpus[-1]}
        assert set(rb.pinned_cpus) == {cpus[-1]}
        worker = pipe._talker.summary()
        assert worker["omp_bind"] == bind and worker["omp_num_threads"] == "1" and worker["torch_threads"] == 1
        got, want = _kv_blocks(pipe, 2 * GiB)
        assert got == want
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == bind and os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_worker_engine_follows_the_reserved_cpu_count(tiny_ckpt, monkeypatch):
    """VLLM_CPU_NUM_OF_RESERVED_CPU=1 on the running engine: the plan reserves the last core as vLLM's auto binding
    does, the talker worker's threads run on the other CPU only, and the worker process sees the variable."""
    need("vllm")
    from omnilab.pipeline import Pipeline
    from omnilab.profiles.readback import process_environ, read_process

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 usable CPUs")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    with Pipeline.from_pretrained(tiny_ckpt(), dtype="float32", deploy="workers") as pipe:
        prof = pipe.profile
        assert prof.reserved_cpus.source == "env (vLLM) VLLM_CPU_NUM_OF_RESERVED_CPU"
        reserved = set(prof.reserved_cpus.value)
        assert len(reserved) == 1 and reserved <= set(cpus)
        pipe.check_profile()
        roles = {role: pid for pid, role in pipe.processes().items()}
        rb = read_process(roles["talker"])
        talker_cpus = {c for mask in rb.thread_cpus for c in mask}
        assert talker_cpus and not talker_cpus & reserved
        assert process_environ(roles["talker"]).get("VLLM_CPU_NUM_OF_RESERVED_CPU") == "1"
