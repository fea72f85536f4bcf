"""Planner, DeployProfile, YAML presets, CLI and worker read-back, on hardware fixtures and this machine."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omnilab.cli.profile import plan_main, probe_main
from omnilab.errors import ConfigError, WorkerError
from omnilab.hardware import GiB, format_cpulist, probe_hardware
from omnilab.profiles import (DeployProfile, ModelGeometry, Resolved, StageTimes, check_process, compare_process,
                              list_presets, plan, read_process, resolve_profile)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "hardware"
FIXTURES = ["vm2_avx2", "vm2_host", "xeon_2s_avx512_smt", "spr_amx_snc2", "graviton3_64", "container_3cpu_8g"]
ROOT = Path(__file__).resolve().parents[2]


def hw(name: str):
    return probe_hardware(FIX / f"{name}.json")


@pytest.fixture(scope="module")
def plans():
    return {n: plan(hw(n), env={}) for n in FIXTURES}


def stage_lists(p: DeployProfile):
    return [*p.talker_cpus.value, p.code2wav_cpus.value]


@pytest.mark.parametrize("name", FIXTURES)
def test_plan_invariants(plans, name):
    h, p = hw(name), plans[name]
    siblings = {c: core.cpus for core in h.cores for c in core.cpus}
    for cpus in stage_lists(p):
        assert len({h.node_of(c) for c in cpus}) == 1, f"{format_cpulist(cpus)} crosses a NUMA node"
        assert not [c for c in cpus if any(s != c and s in cpus for s in siblings[c])], "SMT siblings in one list"
        assert not set(cpus) & set(p.reserved_cpus.value)
        assert set(cpus) <= set(h.usable_cpus)
    assert set(p.reserved_cpus.value) <= set(h.usable_cpus)
    nt, nc, tp = p.talker_threads.value, p.code2wav_threads.value, p.talker_tp_size.value
    limit = math.floor(h.cpu_limit)
    if p.mode.value == "split":
        assert tp * nt + nc <= limit
    else:
        assert nt <= limit and nc == 1 and set(p.code2wav_cpus.value) <= set(p.talker_cpus.value[0])
    assert p.kv_cache_bytes.value <= p.memory_cap_bytes <= h.memory_available_bytes
    assert (p.dtype.value == "bfloat16") == h.native_bf16()[0]
    for field, r in p.resolved().items():
        assert isinstance(r, Resolved) and r.reason.strip() and r.source == "auto", field
    assert p.warnings == ()
    assert DeployProfile.from_yaml(p.to_yaml()) == p
    env = p.to_env("talker")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "|".join(format_cpulist(r) for r in p.talker_cpus.value)
    assert env["OMP_NUM_THREADS"] == str(nt) and p.to_env("code2wav")["OMP_NUM_THREADS"] == str(nc)
    assert p.engine_args("talker")["kv_cache_memory_bytes"] == p.kv_cache_bytes.value
    assert sum(p.chunk_sizes(250)) == 250 and p.chunk_sizes(250)[0] == p.first_chunk_frames.value


def test_two_core_vm_shares_cores_because_the_talker_dominates(plans):
    p = plans["vm2_avx2"]
    assert p.mode.value == "shared" and p.talker_cpus.value == ((0, 1),) and p.code2wav_cpus.value == (1,)
    assert p.dtype.value == "float32" and p.reserved_cpus.value == ()
    assert "split" in p.mode.reason  # the rejected alternative and its estimate are stated
    assert p.estimate.rtf > 1 and "RTF" in p.first_chunk_frames.reason and "stalls" in p.first_chunk_frames.reason
    assert p.kv_cache_bytes.value == GiB and p.to_env("talker")["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # both stages cost the same (measured): a core each would win on the stages alone (the old choice), but a split
    # takes both CPUs and vLLM's engine core and the client then run on them (x FRONT_END_PENALTY, measured), so
    # the plan stays in one process and says why
    even = plan(hw("vm2_avx2"), stage_times=StageTimes(100, 100), env={})
    assert even.mode.value == "shared" and even.estimate.source == "measured"
    assert "x 1.35: no CPU left for vLLM's engine core" in even.mode.reason


def test_a_split_pays_for_the_front_end_only_without_a_free_cpu(plans, monkeypatch, tiny_ckpt):
    from omnilab.profiles import planner
    # far under real time (the tiny checkpoint) the fastest shared layout is kept, all cores to the talker: with the
    # split scored out, the "fewer CPUs" tie-break among near-equal shared layouts must not leave a core idle
    tiny = plan(hw("vm2_avx2"), tiny_ckpt("custom_voice"), env={})
    assert tiny.mode.value == "shared" and tiny.talker_threads.value == 2 and tiny.estimate.rtf < planner.EASY_SHARE
    assert planner.front_end_penalty("split", 2, 2, ()) == planner.FRONT_END_PENALTY > 1  # every CPU a stage's
    assert planner.front_end_penalty("split", 2, 3, ()) == 1.0  # a CPU left over
    assert planner.front_end_penalty("split", 6, 6, (0,)) == 1.0  # a reserved front-end core
    assert planner.front_end_penalty("shared", 2, 2, ()) == 1.0  # one process: no engine-core process
    x = plans["xeon_2s_avx512_smt"]  # split with a reserved core: scored on its stages alone
    assert x.mode.value == "split" and "engine core" not in x.mode.reason
    monkeypatch.setattr(planner, "FRONT_END_PENALTY", 1.0)  # without the factor, the even 2-core case splits
    even = plan(hw("vm2_avx2"), stage_times=StageTimes(100, 100), env={})
    assert even.mode.value == "split" and even.estimate.frame_ms == pytest.approx(100, rel=0.02)
    monkeypatch.setattr(planner, "FRONT_END_PENALTY", 1.35)
    forced = plan(hw("vm2_avx2"), stage_times=StageTimes(100, 100), env={"OMNILAB_STAGE_MODE": "split"})
    assert forced.mode.value == "split" and forced.estimate.frame_ms == pytest.approx(135, rel=0.02)  # as scored


def test_big_machines_split_and_reserve_a_front_end_core(plans):
    x = plans["xeon_2s_avx512_smt"]
    assert x.mode.value == "split" and x.reserved_cpus.value == (0, 56)
    assert x.dtype.value == "float32" and x.preload.value[0].endswith("libtcmalloc_minimal.so.4")
    s = plans["spr_amx_snc2"]
    assert s.dtype.value == "bfloat16" and any("libiomp5" in lib for lib in s.preload.value)
    g = plans["graviton3_64"]
    assert g.dtype.value == "bfloat16" and g.estimate.rtf < 1 and g.estimate.stall_ms == 0
    assert "no playback stall" in g.first_chunk_frames.reason


def test_container_quota_and_memory_limit_shape_the_plan(plans):
    p = plans["container_3cpu_8g"]
    assert len({c for cpus in stage_lists(p) for c in cpus}) <= 3
    assert p.max_model_len.value < 4096 and "memory cap" in p.max_model_len.reason
    assert p.kv_cache_bytes.value <= p.memory_cap_bytes < 1 * GiB


def test_env_overrides_win_over_arguments_and_presets():
    env = {"OMNILAB_TALKER_THREADS": "1", "OMNILAB_KV_CACHE_GIB": "2", "OMNILAB_FIRST_CHUNK_FRAMES": "4",
           "OMNILAB_DTYPE": "bf16", "OMNILAB_RESERVED_CPUS": "none", "OMNILAB_CHUNK_FRAMES": "16"}
    p = resolve_profile("edge", hardware=hw("xeon_2s_avx512_smt"), env=env, overrides={"talker_threads": 8})
    assert p.talker_threads.value == 1 and p.talker_threads.source == "env OMNILAB_TALKER_THREADS"
    assert p.kv_cache_bytes.value == 2 * GiB and p.first_chunk_frames.value == 4
    assert p.steady_chunk_frames.value == 16 and p.reserved_cpus.value == ()
    assert p.dtype.value == "bfloat16" and "emulated" in p.dtype.reason  # allowed, with the warning
    assert p.chunk_ramp_frames.value == (4, 8, 16) and p.chunk_ramp_frames.source == "preset edge"
    assert p.max_model_len.value == 2048 and p.max_model_len.source == "preset edge"
    a = resolve_profile("edge", hardware=hw("xeon_2s_avx512_smt"), env={}, overrides={"steady_chunk_frames": 32})
    assert a.steady_chunk_frames.value == 32 and a.steady_chunk_frames.source == "argument"


def test_explicit_cpu_lists_and_tensor_parallel_ranks():
    h = hw("xeon_2s_avx512_smt")
    p = plan(h, env={"OMNILAB_TALKER_TP": "2", "OMNILAB_RESERVED_CPUS": "none"})
    assert p.talker_tp_size.value == 2 and len(p.talker_cpus.value) == 2
    assert [{h.node_of(c) for c in r} for r in p.talker_cpus.value] == [{0}, {1}]
    assert "|" in p.to_env("talker")["VLLM_CPU_OMP_THREADS_BIND"]
    q = plan(h, env={"OMNILAB_TALKER_CPUS": "28-35", "OMNILAB_CODE2WAV_CPUS": "36-39"})
    assert q.talker_cpus.value == (tuple(range(28, 36)),) and q.code2wav_cpus.value == (36, 37, 38, 39)
    assert q.mode.value == "split" and q.talker_threads.value == 8 and q.code2wav_threads.value == 4
    cross = plan(h, env={"OMNILAB_TALKER_CPUS": "20-35"})  # legal but slow: reported, not silently accepted
    assert any("crosses NUMA nodes" in w for w in cross.warnings)


@pytest.mark.parametrize("env,match", [
    ({"OMNILAB_TALKER_CPUS": "0-3"}, r"talker rank 0 CPU list '0-3' names CPUs 2-3 outside"),
    ({"OMNILAB_KV_CACHE_GIB": "100"}, r"kv_cache_bytes 100.00 GiB \(env OMNILAB_KV_CACHE_GIB\) is above the memory cap"),
    ({"OMNILAB_TALKER_THREADS": "abc"}, r"OMNILAB_TALKER_THREADS='abc': expected a positive integer"),
    ({"OMNILAB_DTYPE": "fp16"}, r"OMNILAB_DTYPE='fp16'.*float16 is not supported"),
    ({"OMNILAB_TALKER_THREADS": "3"}, r"no CPU placement satisfies talker_threads=3 \(env OMNILAB_TALKER_THREADS\)"),
    ({"OMNILAB_STAGE_MODE": "both"}, r"OMNILAB_STAGE_MODE='both'"),
    ({"OMNILAB_MAX_MODEL_LEN": "100000"}, r"max_model_len=100000 .* exceeds"),
    ({"OMNILAB_TALKER_THREADS": "2", "OMNILAB_TALKER_CPUS": "0"}, r"talker_threads=2 .* has 1 CPUs"),
])
def test_bad_overrides_name_the_value(env, match):
    with pytest.raises(ConfigError, match=match):
        plan(hw("vm2_avx2"), env=env)


def test_bad_profile_files_and_presets(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - stage_id: 0\n    dtype: [float32\n")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML at line \d+"):
        resolve_profile(str(bad), hardware=hw("vm2_avx2"), env={})
    with pytest.raises(ConfigError, match=r"unknown deploy profile 'turbo'.*edge"):
        resolve_profile("turbo", hardware=hw("vm2_avx2"), env={})
    with pytest.raises(ConfigError, match=r"not a complete deploy profile \(missing .*talker_cpus"):
        DeployProfile.from_yaml(Path(sys.modules["omnilab.profiles"].__file__).parent.parent / "presets/edge.yaml")
    one_cpu = probe_hardware({**json.loads((FIX / "vm2_avx2.json").read_text())["files"],
                              "/proc/self/status": "Cpus_allowed_list:\t0\n"})
    with pytest.raises(ConfigError, match=r"CPU list '0-1' names CPUs 1 outside .* usable CPUs 0"):
        resolve_profile("vm-2core", hardware=one_cpu, env={})
    big = bad.with_name("big.yaml")
    big.write_text(resolve_profile("vm-2core", hardware=hw("vm2_avx2"), env={}).to_yaml().replace(
        "kv_cache_memory_bytes: 1073741824", f"kv_cache_memory_bytes: {64 * GiB}"))
    with pytest.raises(ConfigError, match=r"kv_cache_bytes 64.00 GiB .* above the available memory"):
        resolve_profile(str(big), hardware=hw("vm2_avx2"), env={})


def test_profile_validates_its_own_consistency(plans):
    p = plans["xeon_2s_avx512_smt"]
    with pytest.raises(ConfigError, match="has 15 CPUs but talker_threads is 4"):
        p.replace(talker_threads=4)
    with pytest.raises(ConfigError, match="share CPUs"):
        p.replace(code2wav_cpus=p.talker_cpus.value[0][:4], code2wav_threads=4)
    with pytest.raises(ConfigError, match="reserved CPUs 0"):
        p.replace(reserved_cpus=(0,), talker_cpus=((0,) + p.talker_cpus.value[0][1:],))
    with pytest.raises(ConfigError, match="unknown stage 'vocoder'"):
        p.to_env("vocoder")


def test_presets_resolve_and_round_trip(tmp_path):
    assert {"edge", "offline", "vm-2core"} <= set(list_presets())
    for name in list_presets():
        p = resolve_profile(name, hardware=hw("vm2_avx2"), env={})
        assert p.name == name and all(r.reason for r in p.resolved().values())
        out = tmp_path / f"{name}.yaml"
        p.to_yaml(out)
        assert DeployProfile.from_yaml(out) == p
    vm = resolve_profile("vm-2core", hardware=hw("vm2_avx2"), env={})
    fresh = dataclasses.replace(plan(hw("vm2_avx2"), env={}), preload=vm.preload)
    assert vm.resolved() == fresh.resolved()  # the committed preset is today's auto plan for that VM


def test_model_geometry_sets_kv_bytes_per_token(tmp_path):
    def dec(layers, hidden, kv, hd):
        return {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
                "num_attention_heads": 4, "num_key_value_heads": kv, "head_dim": hd}
    cfg = {"tts_model_type": "custom_voice", "tts_model_size": "0b6",
           "talker_config": {**dec(2, 64, 2, 16), "vocab_size": 3072,
                             "code_predictor_config": {**dec(1, 64, 2, 16), "vocab_size": 2048}}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = plan(hw("vm2_avx2"), tmp_path, env={})
    # vLLM's CPU attention runs head_dim 16 at its smallest supported size, 32, and sizes the cache so
    assert "2 layers x 2 x 2 kv heads x 32 (head_dim 16 padded for vLLM's CPU attention) x 4 B" in \
        p.kv_cache_bytes.reason
    assert ModelGeometry.released().kv_bytes_per_token(4) == 28 * 2 * 8 * 128 * 4


def test_cli_probe_and_plan(tmp_path, capsys):
    assert probe_main(["--root", str(FIX / "xeon_2s_avx512_smt.json")]) == 0
    assert "node1: 28-55,84-111" in capsys.readouterr().out
    assert probe_main(["--root", str(FIX / "graviton3_64.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["arch"] == "aarch64"
    out_yaml = tmp_path / "p.yaml"
    assert plan_main(["--root", str(FIX / "vm2_avx2.json"), "--json", "--yaml", str(out_yaml),
                      "--set", "steady_chunk_frames=25"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mode"]["value"] == "shared" and d["steady_chunk_frames"]["source"] == "argument"
    assert DeployProfile.from_yaml(out_yaml).steady_chunk_frames.value == 25
    assert plan_main(["--root", str(FIX / "vm2_avx2.json")]) == 0
    assert "reason" in capsys.readouterr().out
    assert plan_main(["--root", str(FIX / "vm2_avx2.json"), "--deploy-profile", "nope"]) == 2
    assert "unknown deploy profile 'nope'" in capsys.readouterr().err


def test_display(plans):
    p = plans["vm2_avx2"]
    assert repr(p).startswith("DeployProfile('auto', shared") and len(repr(p)) < 250
    text = str(p)
    assert all(field in text for field in p.resolved())
    html = p._repr_html_()
    assert "<table>" in html and html.count("<tr>") == len(p.resolved()) + 1


def test_readback_matches_a_worker_started_with_the_plan():
    live = probe_hardware()
    p = plan(live, env={})
    stage = "code2wav"
    env = {**os.environ, **{k: v for k, v in p.to_env(stage).items() if k != "LD_PRELOAD"}}
    child = subprocess.Popen(["sleep", "30"], env=env, preexec_fn=lambda: os.sched_setaffinity(0, p.cpus(stage)))
    try:
        rb = check_process(p, stage, child.pid)
        assert set(rb.cpus) == set(p.cpus(stage)) and rb.omp_num_threads == p.threads(stage)
        assert rb.num_threads >= 1
        if set(p.cpus("talker")) != set(p.cpus(stage)):
            diffs = compare_process(p, "talker", rb)
            assert diffs and "plan says" in diffs[0]
            with pytest.raises(WorkerError, match=str(child.pid)):
                check_process(p, "talker", child.pid)
        assert compare_process(p, stage, dataclasses.replace(rb, reported_threads=p.threads(stage) + 1))
    finally:
        child.kill()
        child.wait()
    with pytest.raises(WorkerError, match="does not exist"):
        read_process(child.pid)


def test_apply_to_current_process_in_a_worker():
    code = ("import os; from omnilab.hardware import probe_hardware; from omnilab.profiles import plan, "
            "apply_to_current_process; p = plan(probe_hardware(), env={}); apply_to_current_process(p, 'code2wav'); "
            "print(sorted(os.sched_getaffinity(0)) == list(p.cpus('code2wav')), os.environ['OMP_NUM_THREADS'] "
            "== str(p.threads('code2wav')))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNILAB_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**env, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


# ---------------------------------------------------------------- vLLM's CPU variables (the "env (vLLM)" layer)
VLLM = "env (vLLM) "


def test_vllm_kvcache_space_sets_the_kv_budget():
    p = plan(hw("vm2_avx2"), env={"VLLM_CPU_KVCACHE_SPACE": "3"})
    assert p.kv_cache_bytes.value == 3 * GiB and p.kv_cache_bytes.source == VLLM + "VLLM_CPU_KVCACHE_SPACE"
    assert p.to_env("talker")["VLLM_CPU_KVCACHE_SPACE"] == "3" and p.engine_args()["kv_cache_memory_bytes"] == 3 * GiB
    assert VLLM + "VLLM_CPU_KVCACHE_SPACE" in str(p)
    # below OMNILAB_KV_CACHE_GIB, above arguments; the two variables may both be set only when they agree
    assert plan(hw("vm2_avx2"), env={"VLLM_CPU_KVCACHE_SPACE": "3"},
                overrides={"kv_cache_gib": 2}).kv_cache_bytes.value == 3 * GiB
    both = plan(hw("vm2_avx2"), env={"VLLM_CPU_KVCACHE_SPACE": "3", "OMNILAB_KV_CACHE_GIB": "3.0"})
    assert both.kv_cache_bytes.source == "env OMNILAB_KV_CACHE_GIB"
    with pytest.raises(ConfigError, match=r"OMNILAB_KV_CACHE_GIB='2' and VLLM_CPU_KVCACHE_SPACE='3' .* disagree"):
        plan(hw("vm2_avx2"), env={"VLLM_CPU_KVCACHE_SPACE": "3", "OMNILAB_KV_CACHE_GIB": "2"})
    for bad in ("1.5", "0", "lots"):  # vLLM reads int() GiB
        with pytest.raises(ConfigError, match=rf"VLLM_CPU_KVCACHE_SPACE='{bad}'"):
            plan(hw("vm2_avx2"), env={"VLLM_CPU_KVCACHE_SPACE": bad})
    assert resolve_profile("vm-2core", hardware=hw("vm2_avx2"),  # a complete preset is re-planned under the variable
                           env={"VLLM_CPU_KVCACHE_SPACE": "2"}).kv_cache_bytes.value == 2 * GiB


def test_vllm_threads_bind_lists_ranks_and_keywords(plans):
    vm, x = hw("vm2_avx2"), hw("xeon_2s_avx512_smt")
    one = plan(vm, env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert one.talker_cpus.value == ((0,),) and one.talker_cpus.source == VLLM + "VLLM_CPU_OMP_THREADS_BIND"
    assert one.talker_threads.value == 1 and one.to_env("talker")["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    ranks = plan(x, env={"VLLM_CPU_OMP_THREADS_BIND": "1-4|29-32"})
    assert ranks.talker_tp_size.value == 2 and ranks.talker_cpus.value == ((1, 2, 3, 4), (29, 30, 31, 32))
    assert ranks.to_env("talker")["VLLM_CPU_OMP_THREADS_BIND"] == "1-4|29-32"
    # auto (vLLM's default): the planner places the talker, and says who asked
    auto = plan(x, env={"VLLM_CPU_OMP_THREADS_BIND": "AUTO"})
    assert auto.talker_cpus.value == plans["xeon_2s_avx512_smt"].talker_cpus.value
    assert auto.talker_cpus.source == VLLM + "VLLM_CPU_OMP_THREADS_BIND" and auto.talker_cpus.reason.startswith("auto")
    assert plan(x, env={"VLLM_CPU_OMP_THREADS_BIND": "auto", "OMNILAB_TALKER_CPUS": "1-4"}).talker_cpus.value == \
        ((1, 2, 3, 4),)  # auto fixes nothing, so it never conflicts
    with pytest.raises(ConfigError, match=r"OMNILAB_TALKER_CPUS='1-4' and VLLM_CPU_OMP_THREADS_BIND='5-8'"):
        plan(x, env={"VLLM_CPU_OMP_THREADS_BIND": "5-8", "OMNILAB_TALKER_CPUS": "1-4"})
    # nobind, and 'all' (its name before vLLM 0.10): the talker's threads are not pinned
    for word in ("nobind", "all"):
        free = plan(vm, env={"VLLM_CPU_OMP_THREADS_BIND": word})
        assert free.talker_pinned is False and free.talker_cpus.value == ((0, 1),) and free.mode.value == "shared"
        assert free.talker_threads.value == 2 and free.to_env("talker")["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert "nobind" in free.talker_cpus.reason and any("not pinned" in w for w in free.warnings)
        assert DeployProfile.from_yaml(free.to_yaml()) == free
    wide = plan(x, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMNILAB_TALKER_THREADS": "8"})
    assert wide.talker_cpus.value == (tuple(range(112)),) and wide.talker_threads.value == 8
    assert wide.reserved_cpus.value == ()  # unpinned threads may run anywhere: nothing can be kept free
    with pytest.raises(ConfigError, match=r"talker_tp_size=2 .* needs pinned talker CPU lists"):
        plan(x, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMNILAB_TALKER_TP": "2"})
    with pytest.raises(ConfigError, match=r"VLLM_CPU_OMP_THREADS_BIND='0-x'"):
        plan(vm, env={"VLLM_CPU_OMP_THREADS_BIND": "0-x"})


def test_vllm_reserved_cpu_count_reserves_like_vllm(plans):
    """vLLM's auto binding takes the count off the end of each rank's per-node list, last rank first."""
    vm = plan(hw("vm2_avx2"), env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    assert plans["vm2_avx2"].reserved_cpus.value == ()
    assert vm.reserved_cpus.value == (1,) and vm.reserved_cpus.source == VLLM + "VLLM_CPU_NUM_OF_RESERVED_CPU"
    assert vm.talker_cpus.value == ((0,),) and vm.code2wav_cpus.value == (0,)  # one core left: shared
    x = hw("xeon_2s_avx512_smt")
    tp2 = plan(x, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "3", "OMNILAB_TALKER_TP": "2"})
    assert tp2.reserved_cpus.value == (27, 54, 55, 83, 110, 111)  # 1 core of node 0, 2 of node 1 (whole cores)
    assert plans["xeon_2s_avx512_smt"].reserved_cpus.value == (0, 56)
    assert plan(x, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}).reserved_cpus.value == ()
    lists = plan(x, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-7"})
    assert lists.reserved_cpus.value == () and "no effect" in lists.reserved_cpus.reason  # vLLM ignores it too
    assert plan(x, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMNILAB_RESERVED_CPUS": "none"}).reserved_cpus.value == ()
    with pytest.raises(ConfigError, match=r"OMNILAB_RESERVED_CPUS='0' and VLLM_CPU_NUM_OF_RESERVED_CPU='1'"):
        plan(x, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "OMNILAB_RESERVED_CPUS": "0"})
    with pytest.raises(ConfigError, match=r"VLLM_CPU_NUM_OF_RESERVED_CPU='-1'"):
        plan(x, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "-1"})


def test_kv_budget_is_checked_against_the_talker_numa_node(plans):
    """304 GiB fits the 2-socket machine (360 GiB available) but not one node (180 GiB), where vLLM puts it."""
    x = hw("xeon_2s_avx512_smt")
    assert x.memory_available_bytes == 360 * GiB and x.node_memory(0)[1] == x.node_memory(1)[1] == 180 * GiB
    with pytest.raises(ConfigError, match=r"304.00 GiB \(env OMNILAB_KV_CACHE_GIB\) is above the NUMA node \d cap"):
        plan(x, env={"OMNILAB_KV_CACHE_GIB": "304"})
    p = plans["xeon_2s_avx512_smt"]
    with pytest.raises(ConfigError, match=r"304.00 GiB \(argument\) is above the available memory of NUMA node \d "
                                          r"\(180.00 GiB of 192.00 GiB\)"):
        p.replace(kv_cache_bytes=304 * GiB).check(x)
    assert plan(x, env={"OMNILAB_KV_CACHE_GIB": "150"}).kv_cache_bytes.value == 150 * GiB
    assert p.memory_cap_bytes < 180 * GiB  # the cap the planner used is the node's
    # the auto budget for many long streams shrinks to the node, and says so
    many = plan(x, env={"OMNILAB_MAX_NUM_SEQS": "300"})  # 300 x 4096 tokens would need 262 GiB
    assert many.kv_cache_bytes.value <= many.memory_cap_bytes < 180 * GiB and "NUMA node" in many.max_model_len.reason


def test_gpu_memory_utilization_is_a_fraction_of_the_node_memory():
    x = hw("xeon_2s_avx512_smt")
    p = plan(x, env={}, overrides={"gpu_memory_utilization": 0.5})
    weights = ModelGeometry.released().resident_bytes(4)
    assert p.kv_cache_bytes.value == 96 * GiB - weights - 3 * GiB // 4  # ceil(0.5 x 192 GiB) - est. worker RSS
    assert p.kv_cache_bytes.source == "argument" and "gpu_memory_utilization 0.5" in p.kv_cache_bytes.reason
    assert "MemTotal 192.00 GiB" in p.kv_cache_bytes.reason
    # vLLM: an explicit KV size wins in the same layer; a higher layer's fraction wins over a preset's size
    same = plan(x, env={}, overrides={"gpu_memory_utilization": 0.5, "kv_cache_gib": 4})
    assert same.kv_cache_bytes.value == 4 * GiB
    assert plan(x, env={}, defaults={"kv_cache_gib": 4}, overrides={"gpu_memory_utilization": 0.5}
                ).kv_cache_bytes.value == p.kv_cache_bytes.value
    assert plan(x, env={"VLLM_CPU_KVCACHE_SPACE": "8"},
                overrides={"gpu_memory_utilization": 0.5}).kv_cache_bytes.value == 8 * GiB
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0.95 .* above its available 180.00 GiB"):
        plan(x, env={}, overrides={"gpu_memory_utilization": 0.95})
    with pytest.raises(ConfigError, match=r"nothing is left for the KV cache"):
        plan(hw("vm2_avx2"), env={}, overrides={"gpu_memory_utilization": 0.2})
    with pytest.raises(ConfigError, match=r"argument gpu_memory_utilization=1.5: expected a fraction"):
        plan(x, env={}, overrides={"gpu_memory_utilization": 1.5})


def test_deploy_yaml_takes_vllm_bind_keywords_and_memory_keys(tmp_path):
    text = resolve_profile("vm-2core", hardware=hw("vm2_avx2"), env={}).to_yaml()
    talker_bind, c2w_bind = "VLLM_CPU_OMP_THREADS_BIND: 0-1", "VLLM_CPU_OMP_THREADS_BIND: '1'"
    assert talker_bind in text and c2w_bind in text
    for talker, code2wav in (("auto", "all"), ("all", "auto"), ("nobind", "nobind")):
        path = tmp_path / f"{talker}-{code2wav}.yaml"
        path.write_text(text.replace(talker_bind, f"VLLM_CPU_OMP_THREADS_BIND: {talker}")
                        .replace(c2w_bind, f"VLLM_CPU_OMP_THREADS_BIND: {code2wav}"))
        p = resolve_profile(str(path), hardware=hw("vm2_avx2"), env={})
        assert p.talker_pinned is (talker == "auto") and p.talker_cpus.value == ((0, 1),)
        assert p.talker_cpus.source == f"file {path}"
        word = "auto" if talker == "auto" else "nobind"
        with pytest.raises(ConfigError, match=rf"not a complete deploy profile \(missing talker_cpus "
                                              rf"\(VLLM_CPU_OMP_THREADS_BIND is '{word}'\), code2wav_cpus"):
            DeployProfile.from_yaml(path)
    frac = tmp_path / "frac.yaml"  # a vllm-omni stage with gpu_memory_utilization and no kv_cache_memory_bytes
    frac.write_text(text.replace("  kv_cache_memory_bytes: 1073741824\n", "  gpu_memory_utilization: 0.6\n")
                    .replace("        VLLM_CPU_KVCACHE_SPACE: '1'\n", ""))
    p = resolve_profile(str(frac), hardware=hw("xeon_2s_avx512_smt"), env={})
    assert "gpu_memory_utilization 0.6" in p.kv_cache_bytes.reason and p.kv_cache_bytes.source == f"file {frac}"
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("VLLM_CPU_KVCACHE_SPACE: '1'", "VLLM_CPU_KVCACHE_SPACE: '1.5'")
                   .replace("  kv_cache_memory_bytes: 1073741824\n", ""))
    with pytest.raises(ConfigError, match=r"bad.yaml: stage 0 VLLM_CPU_KVCACHE_SPACE='1.5': vLLM reads a whole"):
        resolve_profile(str(bad), hardware=hw("vm2_avx2"), env={})


def test_env_help_lists_the_vllm_variables():
    from omnilab.profiles.overrides import env_help
    text = env_help()
    for var in ("OMNILAB_KV_CACHE_GIB", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        assert var in text


def test_left_context_is_not_a_profile_field_and_says_so():
    """omnilab's code2wav carries its exact state between chunks, so a left-context setting would do nothing:
    the variable is refused, and a vllm-omni file's ``codec_left_context_frames`` is read with a warning."""
    with pytest.raises(ConfigError, match="OMNILAB_LEFT_CONTEXT_FRAMES='72' is not used any more.*unset it"):
        plan(hw("vm2_avx2"), env={"OMNILAB_LEFT_CONTEXT_FRAMES": "72"})
    p = plan(hw("vm2_avx2"), env={})
    assert "left_context_frames" not in p.resolved()
    doc = yaml.safe_load(p.to_yaml())
    assert "codec_left_context_frames" not in doc["connectors"]["connector_of_shared_memory"]["extra"]
    doc["connectors"]["connector_of_shared_memory"]["extra"]["codec_left_context_frames"] = 72
    got = resolve_profile(doc, hardware=hw("vm2_avx2"), env={})
    assert got.values() == p.values()
    assert any("codec_left_context_frames=72 is not applied" in w for w in got.warnings)
