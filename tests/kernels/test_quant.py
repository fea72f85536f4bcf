"""Weight quantization reference (omnilab/kernels/quant.py): error bounds, the packed layout, activation codes."""
from __future__ import annotations

import pytest
import torch

from omnilab.kernels import quant

U = 2.0 ** -24  # fp32 unit roundoff


def _w(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    w[1] = 0.0  # an all-zero row (scale 0)
    w[2, 5] = 40.0 / k ** 0.5  # an outlier
    return w


@pytest.mark.parametrize("n,k", [(37, 70), (64, 1024), (16, 32), (5, 3)])
def test_int8_error_is_at_most_half_a_step(n, k):
    w = _w(n, k) if k > 5 else torch.randn(n, k)
    qw = quant.quantize_int8(w)
    q, s = qw.codes(), qw.row_scales()[:, 0]
    assert q.dtype == torch.int8 and q.shape == (n, k) and int(q.abs().max()) <= 127
    torch.testing.assert_close(s, w.abs().amax(1) / 127, rtol=0, atol=0)
    nonzero = s > 0
    assert torch.equal(q[nonzero].abs().amax(1), torch.full((int(nonzero.sum()),), 127, dtype=torch.int8))
    err = (w - qw.dequantize()).abs()
    assert bool((err <= s[:, None] / 2 + 2 * U * w.abs()).all()), float((err - s[:, None] / 2).max())
    assert qw.group_size == k and qw.groups == 1 and qw.bits == 8


@pytest.mark.parametrize("gs", quant.INT4_GROUP_SIZES)
@pytest.mark.parametrize("n", [37, 16])
def test_int4_error_is_at_most_half_a_step_per_group(gs, n):
    k = 384
    w = _w(n, k, seed=gs)
    qw = quant.quantize_int4(w, gs)
    q, s = qw.codes(), qw.row_scales()
    assert s.shape == (n, k // gs) and int(q.min()) >= -7 and int(q.max()) <= 7
    # the scale is max|w| / 7 rounded to fp16 and stored as fp16 (half the scale bytes); if rounding lowered it,
    # the largest element clips by at most 2^-11 max|w| < step / 2, so the half-step bound below still holds
    assert qw.scales.dtype == torch.float16
    torch.testing.assert_close(s, (w.reshape(n, k // gs, gs).abs().amax(-1) / 7).half().float(), rtol=0, atol=0)
    step = s.repeat_interleave(gs, dim=1)
    err = (w - qw.dequantize()).abs()
    assert bool((err <= step / 2 + 2 * U * w.abs()).all()), float((err - step / 2).max())


@pytest.mark.parametrize("method,gs,lo,hi", [("int8", None, -128, 127), ("int4", 32, -8, 7), ("int4", 64, -8, 7),
                                             ("int4", 128, -8, 7)])
@pytest.mark.parametrize("n,k", [(37, 256), (16, 128), (3, 384)])
def test_pack_unpack_round_trip_is_exact(method, gs, lo, hi, n, k):
    """Any codes of the full range (-128 for int8, -8 for int4 included) and scales come back bit for bit."""
    g = torch.Generator().manual_seed(n * k)
    codes = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    groups = 1 if method == "int8" else k // gs
    scales = torch.rand(n, groups, generator=g)
    qw = quant.from_codes(method, codes, scales, gs)
    assert torch.equal(qw.codes(), codes) and torch.equal(qw.row_scales(), scales)
    assert torch.equal(qw.dequantize(), codes.float() * scales.repeat_interleave(k // groups, dim=1))
    if n > 16:
        blocks = qw.dequantize(slice(1, 2))  # rows 16..31, padded rows included
        assert blocks.shape == (16, k) and torch.equal(blocks[: n - 16], qw.dequantize()[16:32])


def test_int8_odd_k_round_trip():
    codes = torch.randint(-128, 128, (5, 45), dtype=torch.int8)
    qw = quant.from_codes("int8", codes, torch.rand(5))
    assert qw.padded_k == 64 and qw.padded_n == 16 and torch.equal(qw.codes(), codes)


def test_layout_bytes():
    """The documented byte positions (what qgemv.cpp reads)."""
    n, k = 20, 64
    codes8 = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    q8 = quant.from_codes("int8", codes8, torch.ones(n)).qweight
    assert q8.shape == (2, 16, 16, 4)
    for i, c, r, j in [(0, 0, 0, 0), (0, 3, 5, 2), (1, 15, 3, 3), (1, 7, 2, 1)]:
        assert int(q8[i, c, r, j]) == int(codes8[16 * i + r, 4 * c + j]) + 128
    assert int(q8[1, 0, 4, 0]) == 128  # padded row: code 0
    codes4 = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    q4 = quant.from_codes("int4", codes4, torch.ones(n, 2), 32).qweight
    assert q4.shape == (2, 8, 16, 4)
    for i, c, r, j in [(0, 0, 0, 0), (0, 5, 9, 3), (1, 7, 3, 1)]:
        byte = int(q4[i, c, r, j])
        assert byte & 15 == int(codes4[16 * i + r, 8 * c + j]) + 8
        assert byte >> 4 == int(codes4[16 * i + r, 8 * c + 4 + j]) + 8
    sc = quant.from_codes("int4", codes4, torch.arange(n * 2, dtype=torch.float32).reshape(n, 2), 32).scales
    assert sc.shape == (2, 2, 16) and float(sc[1, 1, 3]) == 2 * 19 + 1 and float(sc[1, 0, 5]) == 0
    # int4 scales fp16 can hold exactly are stored as fp16; others stay fp32, never rounded
    assert sc.dtype == torch.float16
    inexact = torch.full((n, 2), 0.1)
    kept = quant.from_codes("int4", codes4, inexact, 32)
    assert kept.scales.dtype == torch.float32 and torch.equal(kept.row_scales(), inexact)
    assert quant.from_codes("int8", codes4, torch.ones(n), None).scales.dtype == torch.float32


def test_k_not_divisible_by_the_group_size_is_an_error():
    with pytest.raises(ValueError, match="K=100 is not a multiple of 32.*32, 64, 128"):
        quant.quantize_int4(torch.randn(8, 100), 32)
    with pytest.raises(ValueError, match="K=160 is not a multiple of 128"):
        quant.quantize_int4(torch.randn(8, 160), 128)
    with pytest.raises(ValueError, match=r"group_size must be one of \(32, 64, 128\), got 48"):
        quant.quantize_int4(torch.randn(8, 96), 48)
    with pytest.raises(ValueError, match="unknown method 'int2'"):
        quant.quantize(torch.randn(8, 96), "int2")


def test_bad_codes_and_layouts_are_errors():
    with pytest.raises(ValueError, match=r"int4 codes must lie in \[-8, 7\], got \[-9"):
        quant.from_codes("int4", torch.full((4, 32), -9, dtype=torch.int8), torch.ones(4, 1), 32)
    qw = quant.quantize_int8(torch.randn(20, 40))
    with pytest.raises(ValueError, match="needs contiguous uint8 qweight"):
        quant.QuantizedWeight("int8", 40, (20, 40), qw.qweight[:1], qw.scales)


def test_nbytes_and_repr():
    qw = quant.quantize_int4(torch.randn(3072, 1024), 32)
    assert qw.nbytes == 3072 * 1024 // 2 + 3072 * 32 * 2 == quant.packed_nbytes((3072, 1024), "int4", 32)
    assert quant.quantize_int8(torch.randn(30, 50)).nbytes == 32 * 64 + 32 * 4
    assert "int4, group_size=32, shape=(3072, 1024)" in repr(qw)


def test_quantize_dtypes_and_zero_matrix():
    w = torch.randn(32, 64).bfloat16()
    assert torch.equal(quant.quantize_int8(w).codes(), quant.quantize_int8(w.float()).codes())
    z = quant.quantize_int4(torch.zeros(16, 64), 64)
    assert torch.equal(z.dequantize(), torch.zeros(16, 64)) and float(z.scales.abs().max()) == 0


def test_activation_codes():
    """Per row and 32-wide block: codes in [-127, 127], the block max at +-127, |x - xq * xs| <= xs / 2,
    zero padding and zero blocks give zero codes and scale."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 70, generator=g)
    x[1, 32:64] = 0
    xq, xs = quant.quantize_activations(x)
    assert xq.shape == (3, 96) and xs.shape == (3, 3)
    assert int(xq.abs().max()) == 127 and bool((xq[:, 70:] == 0).all())
    assert float(xs[1, 1]) == 0 and bool((xq[1, 32:64] == 0).all())
    step = xs.repeat_interleave(32, dim=1)[:, :70]
    assert bool(((x - xq[:, :70].float() * step).abs() <= step / 2 + 2 * U * x.abs()).all())


@pytest.mark.parametrize("method,gs", [("int8", None), ("int4", 32), ("int4", 128)])
def test_int8_act_reference(method, gs):
    """The int8-activation result is ``x @ dequantize().T`` within the activation rounding:
    |error| <= sum_k (xs_k / 2) |dq_k| (+ fp32 rounding)."""
    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(40, 256, generator=g), torch.randn(5, 256, generator=g)
    qw = quant.quantize(w, method, gs)
    dq = qw.dequantize()
    got, want = quant.int8_act_reference(x, qw), x @ dq.T
    _, xs = quant.quantize_activations(x)
    bound = (xs.repeat_interleave(32, dim=1) / 2) @ dq.abs().T + 64 * 256 * U * (x.abs() @ dq.abs().T)
    assert bool(((got - want).abs() <= bound).all())
    assert float((got - want).abs().max()) > 0  # the activations are quantized for real


def test_least_squares_int4_scales_reduce_the_weighted_error_of_round_to_nearest():
    """By construction: d = 0 is round to nearest's codes with the scale refitted (never worse), so per group the
    least-squares error is at most RTN's plus what rounding the scale to fp16 adds (relative 2^-11 on the scale:
    at most ~2 * 2^-11 of the group's energy ``sum u x^2`` for a fitted scale); over a Gaussian matrix it is
    clearly lower (the grid also clips)."""
    from omnilab.kernels.quant import _symmetric, wls_int4

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    x = w.reshape(64, 8, 32)  # [N, groups, 32]
    q_r, s_r = _symmetric(x, 7)
    q_w, s_w = wls_int4(x)
    assert q_w.dtype == torch.int8 and int(q_w.abs().max()) <= 7
    err_r = ((x - s_r.unsqueeze(-1) * q_r.float()) ** 2).sum(-1)  # [N, groups], uniform weights (WLS_WEIGHTS)
    err_w = ((x - s_w.unsqueeze(-1) * q_w.float()) ** 2).sum(-1)
    assert bool((err_w <= err_r + 4 * 2 ** -11 * (x * x).sum(-1)).all())
    assert float(err_w.sum()) < 0.9 * float(err_r.sum())
    # the dequantized matrix through the kernel layout is codes * scales, scales fp16-exact
    qw = quant.quantize_int4(w, 32, scales="wls")
    assert torch.equal(qw.row_scales(), qw.row_scales().half().float())
    assert torch.equal(qw.dequantize(), (q_w.float() * s_w.unsqueeze(-1)).reshape(64, 256))


def test_fp16_scales_round_trip_through_the_packed_file_format():
    """What quantize_checkpoint stores for least-squares int4 (fp16 scales) reads back to the same weights."""
    from omnilab.checkpoint.quantized import pack_int32, unpack_int32
    from omnilab.kernels.quant import from_codes

    qw = quant.quantize_int4(torch.randn(40, 128, generator=torch.Generator().manual_seed(1)), 64, scales="wls")
    disk = qw.row_scales().half()  # [N, groups] as stored
    back = from_codes("int4", unpack_int32(pack_int32(qw.codes(), 4), 4, 128), disk.float(), 64)
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.scales, qw.scales)
    with pytest.raises(ValueError, match="accepted: wls, rtn"):
        quant.quantize_int4(torch.zeros(16, 64), 32, scales="gptq")
