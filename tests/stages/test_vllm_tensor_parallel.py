"""A tensor-parallel talker on vLLM's CPU backend (omnilab/stages/vllm/tensor_parallel.py), on this 2-core machine:
two ranks, one core each (the profile's ``|`` lists), against the one-rank result.

A rank's o_proj / down_proj outputs are partial sums that vLLM's all-reduce adds, so a layer's output is the same sum
in another order: equal up to fp32 rounding, not bit for bit (on any CPU). On plain random weights greedy decoding
meets near-ties that rounding flips (mid, fp32: the first change after ~8 frames); the engine test runs on confident
checkpoints (docs/quality.md#confident-random-checkpoints), whose decisions have margins far above it, and asserts
(1) identical greedy codes on every frame (up to 23) and (2) each frame's hidden state equal to the one-rank run's
within a tolerance fp32 rounding of a reordered sum justifies. A missing or wrong all-reduce, a wrong slice or a
rank out of step breaks both at the first frame; a difference names its frame, codebook and the one-rank top-2
margin there.
"""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

from omnilab.errors import ConfigError, InputError, WorkerError
from omnilab.stages.vllm.config import VllmStageConfig, engine_cpu_env, engine_kwargs
from omnilab.stages.vllm.tensor_parallel import check_shardable, shard_talker
from tests.stages._vllm_common import VARIANTS, first_difference, greedy

CPUS = sorted(os.sched_getaffinity(0))
RANKS = ((CPUS[0],), (CPUS[-1],))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="two ranks need two CPUs")


# ---------------------------------------------------------------- the slices (no engine)
@pytest.mark.parametrize("method", ["none", "int8", "int4"])
def test_rank_slices_add_up_to_the_whole_matrix(tiny_ckpt, method):
    """Each rank keeps exact values of the unsplit matrices (quantized ones: the same codes and scales), and the
    row-parallel partial products add up to the unsplit product."""
    from omnilab.checkpoint.load import load_model
    from omnilab.kernels.quant import QuantizedWeight

    from omnilab.kernels.quant import quantization_choice
    # int4 group 32: tiny's o_proj takes 2 heads x 16 = 32 inputs per rank
    quant = None if method == "none" else quantization_choice(method, 32 if method == "int4" else None, env="")
    load = lambda: load_model(tiny_ckpt("custom_voice"), dtype="float32", quantization=quant).talker  # noqa: E731
    whole, ranks = load(), [load(), load()]
    for r, t in enumerate(ranks):
        shard_talker(t, r, 2)

    def dense(w):
        return w.dequantize() if isinstance(w, QuantizedWeight) else w.detach().float()

    for i, layer in enumerate(whole.model.layers):
        a, m = layer.self_attn, layer.mlp
        parts = [(t.model.layers[i].self_attn, t.model.layers[i].mlp) for t in ranks]
        for name, dim in (("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("o_proj", 1)):
            full = dense(getattr(a, name).weight)
            cut = torch.cat([dense(getattr(p[0], name).weight) for p in parts], dim=dim)
            torch.testing.assert_close(cut, full, rtol=0, atol=0)
        for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            full = dense(getattr(m, name).weight)
            cut = torch.cat([dense(getattr(p[1], name).weight) for p in parts], dim=dim)
            torch.testing.assert_close(cut, full, rtol=0, atol=0)
        assert parts[0][0].num_heads * 2 == a.num_heads and parts[1][0].num_kv_heads * 2 == a.num_kv_heads
        x = torch.randn(3, dense(m.down_proj.weight).shape[1])
        want = x @ dense(m.down_proj.weight).T
        got = sum(x[:, r * x.shape[1] // 2:(r + 1) * x.shape[1] // 2] @ dense(p[1].down_proj.weight).T
                  for r, p in enumerate(parts))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same sum, two partial sums added


def test_geometry_that_does_not_split_is_named():
    from omnilab.models.tiny import config
    tc = config("custom_voice").talker  # 4 query heads, 2 key/value heads, MLP 128
    check_shardable(tc, 2)
    with pytest.raises(InputError, match=r"key/value heads 2.*accepted sizes: 1, 2"):
        check_shardable(tc, 4)

    class Int4:
        method, group_size = "int4", 64
    with pytest.raises(InputError, match=r"int4 group size 64 .*\(o_proj input 32 columns"):
        check_shardable(tc, 2, Int4())


# ---------------------------------------------------------------- config, profile, deployment (no engine)
def test_engine_config_carries_ranks_and_bind_lists():
    c = VllmStageConfig(multiprocess=True, tensor_parallel_size=2, talker_cpus=((0,), (1,)), talker_threads=1)
    assert c.rank_cpus == ((0,), (1,))
    assert engine_cpu_env(c, {})["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    kw = engine_kwargs(c, {}, model_dir="/x", dtype="float32", per_token_bytes=1024)
    assert kw["tensor_parallel_size"] == 2
    via_kwargs = VllmStageConfig(multiprocess=True, engine_kwargs={"tensor_parallel_size": 2})
    assert via_kwargs.tensor_parallel_size == 2
    with pytest.raises(InputError, match="needs multiprocess=True"):
        VllmStageConfig(tensor_parallel_size=2)
    with pytest.raises(InputError, match="one CPU list per rank"):
        VllmStageConfig(multiprocess=True, tensor_parallel_size=2, talker_cpus=(0, 1))
    with pytest.raises(ConfigError, match="gives 1 rank list"):
        engine_cpu_env(c, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"})


def test_profile_runs_two_ranks_on_one_node_with_a_warning(monkeypatch, tmp_path):
    from omnilab.hardware import probe_hardware
    from omnilab.profiles.planner import plan
    from omnilab.stages.vllm.deploy import VllmDeploy

    vm = probe_hardware(os.path.join(os.path.dirname(__file__), "..", "fixtures", "hardware", "vm2_avx2.json"))
    p = plan(vm, env={"OMNILAB_TALKER_TP": "2"})
    assert p.talker_tp_size.value == 2 and p.talker_cpus.value == ((0,), (1,))
    assert p.to_env("talker")["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert "no gain expected" in p.talker_tp_size.reason
    assert any("no memory-bandwidth gain" in w for w in p.warnings)
    d = VllmDeploy.from_profile(p)
    assert d.talker.tensor_parallel_size == 2 and d.talker.rank_cpus == ((0,), (1,))
    from omnilab.profiles.profile import DeployProfile
    yaml_text = p.to_yaml()  # the vllm-omni YAML carries tensor_parallel_size and the '|' bind lists
    assert "tensor_parallel_size: 2" in yaml_text
    assert VllmDeploy.from_profile(DeployProfile.from_yaml(yaml_text)).talker.tensor_parallel_size == 2
    with pytest.raises(InputError, match="deploy='workers'"):
        VllmDeploy.from_profile(p, multiprocess=False)
    with pytest.raises(ConfigError, match="needs a physical core of its own; 2 usable"):
        plan(vm, env={"OMNILAB_TALKER_TP": "3"})
    two_socket = probe_hardware(os.path.join(os.path.dirname(__file__), "..", "fixtures", "hardware",
                                             "xeon_2s_avx512_smt.json"))
    auto = plan(two_socket, env={})  # one rank per node is estimated, stated, and proposed only for a 10 % gain
    assert auto.talker_tp_size.value == 1 and "2 ranks, one per NUMA node: est." in auto.talker_tp_size.reason
    assert "under the 10%" in auto.talker_tp_size.reason
    asked = plan(two_socket, env={"OMNILAB_TALKER_TP": "2", "OMNILAB_RESERVED_CPUS": "none"})
    assert "one rank per NUMA node: est. talker" in asked.talker_tp_size.reason and not asked.warnings


# ---------------------------------------------------------------- the engine: two ranks, one core each
@pytest.fixture(scope="module")
def confident(random_ckpt):
    """``confident(size, variant)``: the confident tiny (seed 0) or mid (seed 1, the 1.7B structure) checkpoint."""
    return lambda size, variant: random_ckpt(size, variant, 0 if size == "tiny" else 1, calibrated=True)


def _tp_stage(model, **kw):
    from omnilab.stages.vllm.engine import VllmTalkerStage
    return VllmTalkerStage(model, VllmStageConfig(multiprocess=True, tensor_parallel_size=2, talker_cpus=RANKS,
                                                  talker_threads=1, max_model_len=512, block_size=32, **kw))


def _run(stage, preq, params, rid="r"):
    stage.add_request(rid, preq, params)
    codes, hidden = [], []
    while stage.has_unfinished():
        for o in stage.step(return_hidden=True):
            if o.request_id == rid and o.codes is not None:
                codes.append(torch.as_tensor(o.codes))
                hidden.append(torch.as_tensor(o.hidden).float())
    return torch.stack(codes), torch.stack(hidden)


def _assert_same_codes(model, ref, got, params, label):
    """Assertions (1) and (2) of the module docstring."""
    (c1, h1), (c2, h2) = ref, got
    assert len(c1) >= 16, f"{label}: the one-rank run gave {len(c1)} frames"
    n = min(len(c1), len(c2))
    k = next((k for k in range(n) if not torch.equal(c1[k], c2[k])), n - 1)
    # up to the first difference both ran on one history. fp32 rounding of a reordered sum: relative ~1e-7 per add
    # over K <= 768 terms, through 2-4 layers and the norm; 1e-4 of the largest |h| holds that with room
    scale = float(h1[:k + 1].abs().max())
    torch.testing.assert_close(h2[:k + 1], h1[:k + 1], rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{label}: {m}")
    assert c1.shape == c2.shape and torch.equal(c1, c2), f"{label}: {first_difference(model, c1, h1, c2, params)}"


def _tp_cases():
    """tiny and mid x every variant, and mid at int8; the fast tier keeps TP=2 on tiny CustomVoice."""
    for size, variant, quant in [(s, v, None) for s in ("tiny", "mid") for v in VARIANTS] + [("mid", "custom_voice",
                                                                                              "int8")]:
        fast = (size, variant, quant) == ("tiny", "custom_voice", None)
        yield pytest.param(size, variant, quant, marks=() if fast else pytest.mark.slow,
                           id=f"{size}-{variant}-{quant or 'none'}")


@needs_two
@pytest.mark.vllm
@pytest.mark.parametrize("size,variant,quant", list(_tp_cases()))
def test_two_ranks_follow_one_rank(confident, size, variant, quant):
    from omnilab.checkpoint.load import load_model
    from omnilab.requests import build_request
    from omnilab.stages.eager import EagerTalkerStage, run_to_completion
    from tests.stages._vllm_common import user_requests

    from omnilab.kernels.quant import quantization_choice
    path = confident(size, variant)
    # int8: each rank streams its shard through the quantized kernels (the worker quantizes at load as the client)
    model = load_model(path, dtype="float32", quantization=quantization_choice(quant, env="") if quant else None)
    params = greedy(model, 24)
    preqs = [build_request(model, u)[0] for u in user_requests(variant)[:2]]
    refs = []
    for preq in preqs:  # one rank: the eager engine (vLLM's one-rank talker gives its greedy codes: test_vllm_talker)
        eager = EagerTalkerStage(model)
        eager.add_request("r", preq, params)
        out = run_to_completion(eager.engine, return_hidden=True)["r"]
        refs.append((out["codes"], out["hidden"].float()))
    stage = _tp_stage(model)
    try:
        assert len(stage.processes()) == 3  # engine core + rank 0 + rank 1
        for i, (preq, ref) in enumerate(zip(preqs, refs)):
            got = _run(stage, preq, params, rid=f"r{i}")
            _assert_same_codes(model, ref, got, params, f"{size} {variant} {quant or ''} request {i}")
    finally:
        stage.close()


@pytest.mark.slow
@needs_two
def test_abort_close_and_a_dead_rank(tiny_ckpt):
    from omnilab.checkpoint.load import load_model
    from omnilab.requests import build_request
    from tests.stages._vllm_common import user_requests

    model = load_model(tiny_ckpt("custom_voice"), dtype="float32")
    preq = build_request(model, user_requests("custom_voice")[0])[0]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    stage = _tp_stage(model)
    procs = stage.processes()
    assert sorted(procs.values()) == ["talker", "talker-engine-core", "talker-rank1"]
    stage.add_request("a", preq, greedy(model, 40))
    stage.step()
    assert stage.abort("a").finish_reason == "abort" and not stage.has_unfinished()
    codes, _ = _run(stage, preq, greedy(model, 6), rid="b")  # the ranks carry on after an abort
    assert len(codes) >= 1
    rank1 = next(pid for pid, role in procs.items() if role == "talker-rank1")
    os.kill(rank1, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(WorkerError, match="dead"):
        _run(stage, preq, greedy(model, 6), rid="c")
    assert time.perf_counter() - t0 < 15
    stage.close()
    deadline = time.time() + 15
    while time.time() < deadline and (set(procs) - {os.getpid()}) & {p.pid for p in psutil.Process().children(
            recursive=True)}:
        time.sleep(0.2)
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not (set(procs) & left), f"processes left after close: {left}"
