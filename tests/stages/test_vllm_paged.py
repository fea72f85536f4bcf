"""The vLLM talker's decode steps through omnilab's one-call stack over vLLM's paged KV cache
(``OmnilabTalkerForVLLM._paged_decode``, ``attn.cpp``'s ``omnilab_paged_attn``): the cache layout is the one vLLM's
own CPU ops write and read, decode steps take it (and the codes equal eager's), ``OMNILAB_DECODE_STEP=layer``
turns it off with the same codes, and concurrent rows equal solo ones."""
from __future__ import annotations

import pytest

from _deps import need  # noqa: E402
import torch

need("vllm")

from vllm import _custom_ops as ops  # noqa: E402

from omnilab.checkpoint.load import load_model  # noqa: E402
from omnilab.kernels import attention  # noqa: E402
from omnilab.kernels.norm import rms_norm_torch  # noqa: E402
from omnilab.requests import build_request  # noqa: E402
from omnilab.stages.vllm.engine import VllmStageConfig, VllmTalkerStage  # noqa: E402

from _vllm_common import eager_codes, greedy, user_requests, vllm_run  # noqa: E402

pytestmark = pytest.mark.vllm
EPS = 1e-6


def _lib():
    lib = attention._SLOT.loaded() if attention.attention_choice().mode == "omnilab" else None
    if lib is None:
        pytest.skip("the decode-attention kernel is not in use on this machine")
    return lib


# (omnilab paged vs omnilab contiguous, omnilab vs vLLM) tolerances per dtype. fp32: fp32 rounding of another
# summation order (1e-5); vLLM's own exp and order (1e-4). bf16: the same fp32 sums before one rounding to bf16, so
# an output may land one bf16 ulp apart (2^-8 relative: 8e-3); vLLM's bf16 attention rounds on its own path as well
# (3e-2). A wrong layout gives errors of the values' size, ~1.
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (8e-3, 3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hq,hkv,d,dp,bs", [(4, 2, 16, 32, 32), (16, 8, 128, 128, 128), (8, 2, 64, 64, 32)])
def test_layout_is_the_one_vllms_ops_write_and_read(hq, hkv, d, dp, bs, dtype):
    """Prefix tokens written by vLLM's ``cpu_attn_reshape_and_cache`` ("vec" ISA, heads zero-padded to Dp as the
    talker pads them), the new token by omnilab's kernel: vLLM's ``cpu_attention_with_kv_cache`` over that cache
    gives omnilab's output, and omnilab's contiguous kernel over the same rows too (``TOL``)."""
    lib = _lib()
    own_tol, vllm_tol = TOL[dtype]
    g = torch.Generator().manual_seed(0)
    positions = [3, 45, 160]
    b, nblocks = len(positions), 16
    order = torch.randperm(nblocks, generator=g)
    need = [(p + 1 + bs - 1) // bs for p in positions]
    table = torch.zeros(b, max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = order[at:at + n].to(torch.int32)
        at += n
    cache = torch.zeros(nblocks, hkv, bs, 2 * dp, dtype=dtype)
    kc, vc = cache.view(nblocks, hkv, 2 * bs, dp).chunk(2, dim=2)
    ks = [torch.randn(p, hkv, d, generator=g).to(dtype) for p in positions]
    vs = [torch.randn(p, hkv, d, generator=g).to(dtype) for p in positions]
    pad = lambda t: torch.nn.functional.pad(t, (0, dp - d))  # noqa: E731
    for i, p in enumerate(positions):
        slots = torch.tensor([int(table[i, j // bs]) * bs + j % bs for j in range(p)], dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(pad(ks[i]), pad(vs[i]), kc, vc, slots, "vec", k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(dtype)
    nw = torch.ones(hq + hkv, d, dtype=dtype)
    cos, sin = torch.ones(b, d, dtype=dtype), torch.zeros(b, d, dtype=dtype)  # RoPE as the identity: q is normed q
    got = attention.paged_attention(lib, qkv, nw, EPS, cos, sin, cache, table, positions, hq, hkv, d, d ** -0.5)

    # omnilab's contiguous kernel over the same rows
    kbufs = [torch.cat([k.transpose(0, 1), torch.zeros(hkv, 1, d, dtype=dtype)], 1).contiguous() for k in ks]
    vbufs = [torch.cat([v.transpose(0, 1), torch.zeros(hkv, 1, d, dtype=dtype)], 1).contiguous() for v in vs]
    want = attention.decode_attention(qkv[:, None].contiguous(), nw, EPS, cos[:, None].contiguous(),
                                      sin[:, None].contiguous(), kbufs, vbufs, positions, hq, hkv, d, d ** -0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want[:, 0], rtol=own_tol, atol=own_tol)

    # vLLM's attention over the cache omnilab wrote into
    q = rms_norm_torch(qkv[:, :hq * d].view(b, hq, d), nw[:hq], EPS)
    seq_lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=b, num_heads=hq, num_kv_heads=hkv, head_dim=dp,
                                               seq_lens=seq_lens, dtype=dtype, query_start_loc=qsl,
                                               causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False)
    out = torch.empty(b, hq, dp, dtype=dtype)
    ops.cpu_attention_with_kv_cache(query=pad(q).contiguous(), key_cache=kc, value_cache=vc, output=out,
                                    query_start_loc=qsl, seq_lens=seq_lens, scale=d ** -0.5, causal=True,
                                    alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                                    scheduler_metadata=meta, s_aux=None)
    torch.testing.assert_close(got.view(b, hq, d), out[..., :d], rtol=vllm_tol, atol=vllm_tol)
    assert not out[..., d:].any()  # the pads omnilab wrote are zero (vLLM's output over them is 0)


@pytest.fixture(scope="module")
def stage(tiny_ckpt):
    model = load_model(tiny_ckpt("custom_voice"), dtype="float32")
    st = VllmTalkerStage(model, VllmStageConfig(max_model_len=256, block_size=32, max_num_seqs=4))
    yield model, st
    st.close()


def _paged_steps(st) -> int:
    return st.runner.model.paged_steps


def test_decode_steps_take_the_paged_stack_and_equal_eager(stage, monkeypatch):
    model, st = stage
    _lib()
    preq, _ = build_request(model, user_requests("custom_voice")[0])
    ref = eager_codes(model, preq, greedy(model))
    before = _paged_steps(st)
    got, _ = vllm_run(st, preq, greedy(model))
    assert torch.equal(got, ref)
    assert _paged_steps(st) - before == got.shape[0] - 1  # every step after the prefill's
    monkeypatch.setenv("OMNILAB_DECODE_STEP", "layer")  # per-layer calls only: vLLM's attention layers run
    before = _paged_steps(st)
    again, _ = vllm_run(st, preq, greedy(model), rid="layer")
    assert _paged_steps(st) == before and torch.equal(again, ref)


def test_concurrent_rows_equal_solo(stage):
    """Two requests decoding together (B=2 rows in the stack, blocks of both in one table) give their solo codes."""
    model, st = stage
    _lib()
    reqs = [build_request(model, u)[0] for u in user_requests("custom_voice")]
    solo = [vllm_run(st, p, greedy(model, 12), rid=f"solo{i}")[0] for i, p in enumerate(reqs)]
    before = _paged_steps(st)
    for i, p in enumerate(reqs):
        st.add_request(f"pair{i}", p, greedy(model, 12))
    frames: dict = {}
    while st.has_unfinished():
        for o in st.step():
            if o.codes is not None:
                frames.setdefault(o.request_id, []).append(o.codes)
    assert _paged_steps(st) > before
    for i in range(2):
        assert torch.equal(torch.stack(frames[f"pair{i}"]), solo[i]), i


def test_a_bf16_talker_gets_the_vec_layout_and_takes_the_paged_stack(tiny_ckpt):
    """bf16 compute: the worker has vLLM lay its caches out as "vec" (where AMX CPUs would get "amx", which the
    kernel does not read), so every decode step after the prefill runs the one-call stack. Codes are not compared
    with eager's here: the prefill runs vLLM's bf16 attention, which rounds on its own path (the bound between the
    two is tests/stages/test_vllm_bf16.py's)."""
    _lib()
    model = load_model(tiny_ckpt("custom_voice"), dtype="bfloat16")
    with VllmTalkerStage(model, VllmStageConfig(max_model_len=256, block_size=32, max_num_seqs=2)) as st:
        vm = st.runner.model
        assert {a.isa for a in vm.stack.attn} == {"vec"}
        preq, _ = build_request(model, user_requests("custom_voice")[0])
        got, _ = vllm_run(st, preq, greedy(model))
        assert vm.paged_steps == got.shape[0] - 1 and got.shape[0] > 1
        assert all(c.dtype == torch.bfloat16 for c in vm._caches_checked)
