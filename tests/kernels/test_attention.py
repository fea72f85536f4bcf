"""omnilab's one-token decode attention kernel (q/k norm, RoPE, cache write, attention): against torch's ops, and
independent of batch mates, thread count and cache capacity."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from omnilab.errors import ConfigError
from omnilab.kernels import attention
from omnilab.kernels.norm import rms_norm_torch
from omnilab.models.decoder import RopeTable

from _kernel_common import fixtures, skip_without_isa  # noqa: E402

skip_without_isa()
lib, fresh_choice = fixtures(attention, "attn")
EPS = 1e-6


def _call(lib, *args):
    slot = attention._SLOT
    saved = slot.choice, slot.lib
    slot.choice, slot.lib = "test", lib
    try:
        return attention.decode_attention(*args)
    finally:
        slot.choice, slot.lib = saved


def _case(b, hq, hkv, d, positions, caps, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(b, 1, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    nw = (torch.randn(hq + hkv, d, generator=g) * 0.2 + 1).to(dtype)
    ks = [(torch.randn(hkv, cap, d, generator=g)).to(dtype) for cap in caps]
    vs = [(torch.randn(hkv, cap, d, generator=g)).to(dtype) for cap in caps]
    rope = RopeTable(d, 10000.0)
    cos, sin = rope.get(torch.tensor(positions)[:, None], dtype, signed=True)  # [B, 1, D]
    return qkv, nw, ks, vs, cos.contiguous(), sin.contiguous()


def _torch(qkv, nw, ks, vs, cos, sin, positions, hq, hkv, d):
    """The decoder's torch ops for one token per row; returns (out [B, 1, Hq*D], k rows, v rows written)."""
    outs, kw, vw = [], [], []
    for i, pos in enumerate(positions):
        row = qkv[i, 0]
        q, k, v = row[:hq * d].view(hq, d), row[hq * d:(hq + hkv) * d].view(hkv, d), row[(hq + hkv) * d:].view(hkv, d)
        qk = rms_norm_torch(torch.cat([q, k]), nw, EPS)
        qk = qk * cos[i] + torch.roll(qk, d // 2, dims=-1) * sin[i]
        q, k = qk[:hq], qk[hq:]
        keys = torch.cat([ks[i][:, :pos], k[:, None]], dim=1)      # [Hkv, pos + 1, D]
        vals = torch.cat([vs[i][:, :pos], v[:, None]], dim=1)
        o = F.scaled_dot_product_attention(q[None, :, None], keys[None], vals[None], scale=d ** -0.5, enable_gqa=True)
        outs.append(o.reshape(1, hq * d))
        kw.append(k)
        vw.append(v)
    return torch.stack(outs), kw, vw


GEOMETRIES = [(1, 4, 2, 16, [0], [8]), (1, 16, 8, 128, [37], [64]), (3, 4, 2, 32, [5, 0, 11], [16, 8, 32]),
              (2, 2, 2, 64, [3, 3], [4, 4])]


@pytest.mark.parametrize("b,hq,hkv,d,positions,caps", GEOMETRIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_ops_and_writes_the_cache(lib, b, hq, hkv, d, positions, caps, dtype):
    """Against the decoder's torch ops: fp32 within fp32 rounding of another summation order (rtol 1e-5), bf16
    within two bf16 steps (the inputs of the softmax may round across a bf16 boundary once); the written k rows
    equal torch's to the norm's few ulp and v rows exactly; the rest of the cache is untouched."""
    qkv, nw, ks, vs, cos, sin = _case(b, hq, hkv, d, positions, caps, dtype)
    before = [k.clone() for k in ks]
    want, kw, vw = _torch(qkv, nw, ks, vs, cos, sin, positions, hq, hkv, d)
    got = _call(lib, qkv, nw, EPS, cos, sin, ks, vs, positions, hq, hkv, d, d ** -0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2 ** -6)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    ktol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    for i, pos in enumerate(positions):
        torch.testing.assert_close(ks[i][:, pos].float(), kw[i].float(), **ktol)
        assert torch.equal(vs[i][:, pos], vw[i])
        mask = torch.ones(caps[i], dtype=torch.bool)
        mask[pos] = False
        assert torch.equal(ks[i][:, mask], before[i][:, mask])


def test_a_row_does_not_depend_on_batch_mates_threads_or_capacity(lib):
    hq, hkv, d = 16, 8, 128
    positions, caps = [40, 7, 90], [64, 16, 128]
    qkv, nw, ks, vs, cos, sin = _case(3, hq, hkv, d, positions, caps, torch.float32)
    ks0, vs0 = [k.clone() for k in ks], [v.clone() for v in vs]
    whole = _call(lib, qkv, nw, EPS, cos, sin, ks, vs, positions, hq, hkv, d, d ** -0.5)
    for i in range(3):
        k2 = torch.zeros(hkv, caps[i] * 2, d)
        v2 = torch.zeros(hkv, caps[i] * 2, d)
        k2[:, :caps[i]], v2[:, :caps[i]] = ks0[i], vs0[i]
        alone = _call(lib, qkv[i:i + 1].contiguous(), nw, EPS, cos[i:i + 1], sin[i:i + 1], [k2], [v2], [positions[i]],
                      hq, hkv, d, d ** -0.5)
        assert torch.equal(alone, whole[i:i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ks1, vs1 = [k.clone() for k in ks0], [v.clone() for v in vs0]
        assert torch.equal(_call(lib, qkv, nw, EPS, cos, sin, ks1, vs1, positions, hq, hkv, d, d ** -0.5), whole)
    finally:
        torch.set_num_threads(threads)


def test_a_position_past_the_capacity_is_an_error_and_odd_shapes_fall_back(lib):
    qkv, nw, ks, vs, cos, sin = _case(1, 4, 2, 16, [8], [8], torch.float32)
    with pytest.raises(RuntimeError, match="positions \\[8\\] for capacities \\[8\\]"):
        _call(lib, qkv, nw, EPS, cos, sin, ks, vs, [8], 4, 2, 16, 0.25)
    assert _call(lib, qkv.double(), nw, EPS, cos, sin, ks, vs, [0], 4, 2, 16, 0.25) is None
    assert _call(lib, qkv, nw, EPS, cos, sin, ks, vs, [0], 3, 2, 16, 0.25) is None  # Hq not a multiple of Hkv


def to_paged(ks, vs, bs, dp, tables, nblocks):
    """Contiguous per-row caches [Hkv, cap, D] -> one paged fp32 cache [blocks, Hkv, bs, 2 Dp] in vLLM's CPU "vec"
    layout (attn.cpp: per (block, head) keys transposed [Dp][bs], then values [bs][Dp]; pads zero), rows' blocks
    at ``tables[b]``; unused blocks hold noise (a kernel that reads them is caught)."""
    hkv, _, d = ks[0].shape
    cache = torch.randn(nblocks, hkv, 2 * bs, dp, generator=torch.Generator().manual_seed(7)) * 100
    for k, v, table in zip(ks, vs, tables):
        for j in range(k.shape[1]):
            blk, off = table[j // bs], j % bs
            kt = cache[blk, :, :bs].view(hkv, dp, bs)  # keys: [Dp][bs]
            kt[:, :d, off], kt[:, d:, off] = k[:, j], 0.0
            cache[blk, :, bs + off, :d], cache[blk, :, bs + off, d:] = v[:, j], 0.0
    return cache.view(nblocks, hkv, bs, 2 * dp)


def paged_rows(cache, table, length, bs, d):
    """Row keys / values [Hkv, length, D] read back from the paged layout."""
    nblocks, hkv, _, two_dp = cache.shape
    c = cache.view(nblocks, hkv, 2 * bs, two_dp // 2)
    ks, vs = [], []
    for j in range(length):
        blk, off = table[j // bs], j % bs
        ks.append(c[blk, :, :bs].reshape(hkv, two_dp // 2, bs)[:, :d, off])
        vs.append(c[blk, :, bs + off, :d])
    return torch.stack(ks, 1), torch.stack(vs, 1)


def _paged(lib, qkv, nw, cos, sin, cache, table, positions, hq, hkv, d):
    return attention.paged_attention(lib, qkv[:, 0].contiguous(), nw, EPS, cos[:, 0].contiguous(),
                                     sin[:, 0].contiguous(), cache, table, positions, hq, hkv, d, d ** -0.5)


@pytest.mark.parametrize("hq,hkv,d,dp", [(4, 2, 16, 32), (16, 8, 128, 128), (4, 4, 64, 64)])
@pytest.mark.parametrize("bs", [32, 128])
def test_paged_matches_the_contiguous_kernel(lib, hq, hkv, d, dp, bs):
    """Over vLLM's paged layout (blocks scattered, rows of 1, 40 and 130 tokens, padded heads): the same output as
    the contiguous kernel within fp32 rounding of another summation order (scores: one FMA chain per token here, a
    lane dot there: D + L rounding steps at most, rtol 1e-5); the new k / v written bitwise as the contiguous kernel
    writes them (the same norm and RoPE code), pads zero, every other slot untouched."""
    positions = [0, 39, 129]
    caps = [p + 1 for p in positions]
    qkv, nw, ks, vs, cos, sin = _case(3, hq, hkv, d, positions, caps, torch.float32, seed=5)
    nblocks = 12
    order = torch.randperm(nblocks, generator=torch.Generator().manual_seed(1)).tolist()
    per = [(c + bs - 1) // bs for c in caps]
    tables, at = [], 0
    for n in per:
        tables.append(order[at:at + n])
        at += n
    table = torch.full((3, max(per) + 2), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    cache = to_paged(ks, vs, bs, dp, tables, nblocks)
    before = cache.clone()
    ks_c, vs_c = [k.clone() for k in ks], [v.clone() for v in vs]
    want = _call(lib, qkv, nw, EPS, cos, sin, ks_c, vs_c, positions, hq, hkv, d, d ** -0.5)[:, 0]
    got = _paged(lib, qkv, nw, cos, sin, cache, table, positions, hq, hkv, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    changed = torch.zeros_like(cache, dtype=torch.bool)
    for i, pos in enumerate(positions):
        k, v = paged_rows(cache, tables[i], pos + 1, bs, d)
        assert torch.equal(k[:, pos], ks_c[i][:, pos]) and torch.equal(v[:, pos], vs_c[i][:, pos])
        blk, off = tables[i][pos // bs], pos % bs
        c = changed.view(nblocks, hkv, 2 * bs, dp)
        c[blk, :, :bs].view(hkv, dp, bs)[:, :, off] = True
        c[blk, :, bs + off] = True
        if dp > d:
            kt = cache.view(nblocks, hkv, 2 * bs, dp)[blk, :, :bs].reshape(hkv, dp, bs)
            assert not kt[:, d:, off].any() and not cache.view(nblocks, hkv, 2 * bs, dp)[blk, :, bs + off, d:].any()
    assert torch.equal(cache[~changed], before[~changed])


def test_paged_row_does_not_depend_on_batch_mates_threads_or_blocks(lib):
    hq, hkv, d = 16, 8, 128
    positions = [70, 5]
    qkv, nw, ks, vs, cos, sin = _case(2, hq, hkv, d, positions, [p + 1 for p in positions], torch.float32, seed=9)
    whole = None
    for bs, tables in ((32, [[0, 1, 2], [3]]), (32, [[7, 2, 5], [1]]), (128, [[1], [0]])):
        cache = to_paged(ks, vs, bs, d, tables, 8)
        table = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)
        got = _paged(lib, qkv, nw, cos, sin, cache, table, positions, hq, hkv, d)
        whole = got if whole is None else whole
        assert torch.equal(got, whole), (bs, tables)
        alone = _paged(lib, qkv[1:].contiguous(), nw, cos[1:], sin[1:], to_paged(ks[1:], vs[1:], bs, d, tables[1:], 8),
                       table[1:].contiguous(), positions[1:], hq, hkv, d)
        assert torch.equal(alone, whole[1:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cache = to_paged(ks, vs, 32, d, [[0, 1, 2], [3]], 8)
        table = torch.tensor([[0, 1, 2], [3, 0, 0]], dtype=torch.int32)
        assert torch.equal(_paged(lib, qkv, nw, cos, sin, cache, table, positions, hq, hkv, d), whole)
    finally:
        torch.set_num_threads(threads)


def test_paged_rejects_block_ids_outside_the_cache(lib):
    qkv, nw, ks, vs, cos, sin = _case(1, 4, 2, 16, [40], [41], torch.float32)
    cache = to_paged(ks, vs, 32, 32, [[0, 1]], 2)
    with pytest.raises(RuntimeError, match="omnilab_paged_attn rejected"):
        _paged(lib, qkv, nw, cos, sin, cache, torch.tensor([[0, 2]], dtype=torch.int32), [40], 4, 2, 16)
    with pytest.raises(RuntimeError, match="omnilab_paged_attn rejected"):
        _paged(lib, qkv, nw, cos, sin, cache, torch.tensor([[0, -1]], dtype=torch.int32), [40], 4, 2, 16)


@pytest.mark.parametrize("quantization", [pytest.param(None, marks=pytest.mark.slow), "int8"])
def test_greedy_codes_match_the_torch_ops_on_the_pipeline(tiny_ckpt, fresh_choice, quantization):
    """The user's path (eager, greedy, tiny checkpoint): the kernel and torch's ops give the same codes (their
    difference is fp32 rounding; the tiny model has no near-tie there — a stated property of this checkpoint,
    checked for both dtypes the ISA rule gives)."""
    from omnilab.pipeline import Pipeline

    import omnilab.models.decoder as decoder

    fresh_choice.setenv("OMNILAB_DECODE_STEP", "off")  # the general path (the direct step is bitwise it: test_decode_step)
    calls = []
    real = decoder.decode_attention
    fresh_choice.setattr(decoder, "decode_attention", lambda *a: _count(calls, real, *a))
    pipe = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32",
                                    quantization=quantization)
    try:
        got = {}
        for mode in ("auto", "torch"):
            calls.clear()
            with attention.use_attention(mode):
                r = pipe.generate("One call per layer.", speaker="vivian", do_sample=False, subtalker_do_sample=False,
                                  max_new_tokens=12)
            got[mode] = np.asarray(r.codes)
            assert (mode == "auto") == (sum(calls) > 0)  # the kernel really ran (and only under auto)
        assert np.array_equal(got["auto"], got["torch"])
        assert attention.attention_choice().mode == "omnilab"
    finally:
        pipe.close()


def _count(calls, real, *args):
    out = real(*args)
    calls.append(out is not None)
    return out


def test_a_bad_mode_names_the_accepted_ones(fresh_choice):
    fresh_choice.setenv(attention.ENV, "quick")
    with pytest.raises(ConfigError, match="OMNILAB_CPU_ATTN='quick'.*accepted: auto"):
        attention.attention_choice()
