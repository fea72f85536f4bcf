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


@pytest.mark.parametrize("quantization", [None, "int8"])
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
