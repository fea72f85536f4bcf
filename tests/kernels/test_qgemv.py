"""omnilab's quantized GEMV kernel (qgemv.cpp / qgemv.py): numerics against the float and int8-activation
references, batch / thread / ISA invariance, dispatch, the torch fallback and the choice rules.

Tolerances (u = 2^-24, fp32 unit roundoff):
- fp32 activations against ``x @ dq.T``: both sides sum K products in fp32 in different orders and the
  kernel applies the scale per group instead of per element: |err| <= (2K + 4) u sum_k |x_k dq_k|.
- int8 / int16 activations against ``quant.int_act_reference`` (the same quantized x, bitwise, and exact block
  dots, each rounded to fp32 once on both sides): only the fp32 sum over the nb = Kp/32 blocks differs:
  |err| <= 2 (nb + 4) u sum_k |xq_k xs_k dq_k|. An activation code off by one (or an int16 pair in the wrong
  slot) would exceed this, so it also checks the kernel's activation codes.
- int8 / int16 activations against ``x @ dq.T``: plus the activation rounding, sum_k (xs_k / 2) |dq_k|.
"""
from __future__ import annotations

import functools
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from omnilab.errors import ConfigError
from omnilab.kernels import qgemv, quant
from omnilab.kernels.build import build_library

from _kernel_common import FLAGS, ISAS, fixtures, skip_without_isa  # noqa: E402

skip_without_isa()
_, fresh_choice = fixtures(qgemv, "qgemv")
# the avx512 build uses vpdpbusd / vpdpwssd: only on CPUs with avx512_vnni and avx512bw (others run the avx2 build)
QISAS = [i for i in ISAS if i != "avx512" or {"avx512_vnni", "avx512bw"} <= set(FLAGS)]
U = 2.0 ** -24
WEIGHTS = [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)]


@pytest.fixture(scope="module", params=QISAS)
def lib(request):
    return qgemv._Lib(build_library("qgemv", request.param))


@functools.lru_cache(maxsize=None)
def _weight(n, k, method, gs, seed):
    g = torch.Generator().manual_seed(seed + 1000)
    return quant.quantize(torch.randn(n, k, generator=g) / k ** 0.5, method, gs), torch.randn(n, generator=g)


def _data(rows, n, k, method, gs, bias=False, seed=0):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    qw, b = _weight(n, k, method, gs, seed)
    return x, qw, (b.clone() if bias else None)


def _assert_within(got, x, qw, bias, activations):
    dq = qw.dequantize()
    k = qw.shape[1]
    ref = F.linear(x, dq, bias)
    mag = x.abs() @ dq.abs().T
    if activations == "fp32":
        bound = (2 * k + 4) * U * mag
    else:
        bits = 16 if activations == "int16" else 8
        xq, xs = quant.quantize_activations(x, qw.padded_k, bits)
        xd = (xq.float() * xs.repeat_interleave(quant.ACT_BLOCK, dim=1))[:, :k]
        nb = qw.padded_k // quant.ACT_BLOCK
        tight = 2 * (nb + 4) * U * (xd.abs() @ dq.abs().T) + 4 * U * (bias.abs() if bias is not None else 0)
        exact = quant.int_act_reference(x, qw, bits) + (bias if bias is not None else 0)
        assert bool(((got - exact).abs() <= tight).all()), float(((got - exact).abs() - tight).max())
        bound = (xs.repeat_interleave(quant.ACT_BLOCK, dim=1)[:, :k] / 2) @ dq.abs().T + (2 * k + 4) * U * mag
    assert bool(((got - ref).abs() <= bound + 4 * U * ref.abs()).all()), float(((got - ref).abs() - bound).max())


ROWS = [1, 2, 3, 4, 7, 8, 16]
SHAPES = [(1024, 1024, False), (37, 384, True), (3, 128, False), (2050, 256, True)]


def _grid():
    """weights x rows x shapes: the fast tier keeps a quarter, in which every value of each axis meets every value
    of each other axis ((i + j + l) % 4 == 0 over their indices); ``--all`` runs the whole grid."""
    for i, (method, gs) in enumerate(WEIGHTS):
        for j, rows in enumerate(ROWS):
            for l, (n, k, bias) in enumerate(SHAPES):
                marks = () if (i + j + l) % 4 == 0 else (pytest.mark.slow,)
                yield pytest.param(method, gs, rows, n, k, bias, marks=marks, id=f"{method}-{gs}-r{rows}-{n}x{k}")


@pytest.mark.parametrize("activations", qgemv.ACTIVATIONS)
@pytest.mark.parametrize("method,gs,rows,n,k,bias", list(_grid()))
def test_kernel_against_references(lib, activations, method, gs, rows, n, k, bias):
    """Every build this CPU runs, each row count of the kernel, tails in N (37, 3, 2050 = 128 blocks + 2)."""
    x, qw, b = _data(rows, n, k, method, gs, bias)
    _assert_within(qgemv.qgemv_rows(x, qw, b, lib=lib, activations=activations), x, qw, b, activations)


@pytest.mark.parametrize("activations", qgemv.ACTIVATIONS)
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", [(37, 70), (19, 5), (64, 1000), (16, 33)])
def test_int8_weights_with_k_tails(lib, activations, rows, n, k):
    """int8 takes any K (padded to a multiple of 32 with zero codes; int4's K is a multiple of its group)."""
    x, qw, b = _data(rows, n, k, "int8", None, True, seed=k)
    _assert_within(qgemv.qgemv_rows(x, qw, b, lib=lib, activations=activations), x, qw, b, activations)


@pytest.mark.parametrize("activations", qgemv.ACTIVATIONS)
def test_zero_rows_outliers_and_all_zero_weights(lib, activations):
    x, qw, b = _data(4, 40, 256, "int4", 32, True)
    x[1] = 0
    x[2, 7] = 1e4  # an outlier: its block's other activations quantize coarsely, other blocks do not care
    y = qgemv.qgemv_rows(x, qw, b, lib=lib, activations=activations)
    assert torch.equal(y[1], b)
    _assert_within(y, x, qw, b, activations)
    z = quant.quantize_int8(torch.zeros(20, 64))
    assert torch.equal(qgemv.qgemv_rows(x[:, :64], z, lib=lib, activations=activations), torch.zeros(4, 20))


@pytest.mark.parametrize("activations", qgemv.ACTIVATIONS)
@pytest.mark.parametrize("method,gs", [("int8", None), ("int4", 32), ("int4", 128)])
def test_rows_do_not_depend_on_batch_or_threads(lib, activations, method, gs):
    """A row's result is bitwise the same alone, among 1..16 rows, and with 1 or 2 threads."""
    x, qw, _ = _data(16, 1040, 1024, method, gs)
    alone = torch.cat([qgemv.qgemv_rows(x[i:i + 1], qw, lib=lib, activations=activations) for i in range(16)])
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for m in (1, 2, 3, 5, 8, 9, 13, 16):
                got = qgemv.qgemv_rows(x[:m], qw, lib=lib, activations=activations)
                assert torch.equal(got, alone[:m]), (m, nt)
                assert torch.equal(qgemv.qgemv_rows(x[16 - m:], qw, lib=lib, activations=activations),
                                   alone[16 - m:]), (m, nt)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(len(QISAS) < 2, reason="needs both the avx512 (VNNI) and the avx2 build")
@pytest.mark.parametrize("activations", qgemv.ACTIVATIONS)
@pytest.mark.parametrize("method,gs", WEIGHTS)
def test_isas_agree_bitwise(activations, method, gs):
    """Exact int32 block dots and the same fp32 steps per lane: avx512 and avx2 give the same bits."""
    libs = [qgemv._Lib(build_library("qgemv", isa)) for isa in QISAS]
    for rows, n, k in [(1, 37, 384), (5, 2050, 256), (16, 64, 128)]:
        x, qw, b = _data(rows, n, k, method, gs, True, seed=rows)
        a, c = (qgemv.qgemv_rows(x, qw, b, lib=li, activations=activations) for li in libs)
        assert torch.equal(a, c), (rows, n, k)


def test_input_layouts(lib):
    """3-D inputs and a strided slice of a sequence give the 2-D result."""
    g = torch.Generator().manual_seed(1)
    qw = quant.quantize_int4(torch.randn(48, 64, generator=g), 32)
    x = torch.randn(2, 3, 64, generator=g)
    flat = qgemv.qgemv_rows(x.reshape(6, 64), qw, lib=lib)
    assert torch.equal(qgemv.qgemv_rows(x, qw, lib=lib), flat.reshape(2, 3, 48))
    seq = torch.randn(4, 5, 64, generator=g)
    assert torch.equal(qgemv.qgemv_rows(seq[:, -1], qw, lib=lib), qgemv.qgemv_rows(seq[:, -1].clone(), qw, lib=lib))


def test_qgemv_rows_rejects_what_it_cannot_do(lib):
    qw = quant.quantize_int8(torch.randn(16, 32))
    with pytest.raises(ValueError, match="1..16 rows, got 17"):
        qgemv.qgemv_rows(torch.randn(17, 32), qw, lib=lib)
    with pytest.raises(TypeError, match="float32"):
        qgemv.qgemv_rows(torch.randn(2, 32, dtype=torch.bfloat16), qw, lib=lib)
    with pytest.raises(ValueError, match="shapes do not fit"):
        qgemv.qgemv_rows(torch.randn(2, 31), qw, lib=lib)
    with pytest.raises(ValueError, match="activations='int4'; accepted: int8, int16, fp32"):
        qgemv.qgemv_rows(torch.randn(2, 32), qw, lib=lib, activations="int4")


@pytest.mark.parametrize("activations", qgemv.ACTIVATIONS)
def test_qlinear_dispatch(fresh_choice, activations):
    """1..16 rows: the kernel; a prefill (17..CHUNKED_MAX_ROWS rows): the kernel in one call (the codes read once
    for all rows), each row equal to the same row computed alone (bitwise); beyond: torch's GEMM over dequantized
    blocks of 1024 output rows (fp32 activations); autograd: the dequantized F.linear; a bf16 input is computed in
    fp32 and cast back."""
    assert qgemv.qgemv_choice().mode == "omnilab"
    g = torch.Generator().manual_seed(2)
    qw = quant.quantize_int4(torch.randn(1100, 128, generator=g), 64)
    b = torch.randn(1100, generator=g)
    xs = [torch.randn(rows, 128, generator=g) for rows in (1, 4, 16, 17, 40)]
    want = [torch.cat([qgemv.qgemv_rows(r[None], qw, b, activations=activations) for r in x]) for x in xs]
    calls = []
    real = qgemv._call
    fresh_choice.setattr(qgemv, "_call", lambda *a: calls.append(a[4]) or real(*a))
    for x, ref in zip(xs, want):
        assert torch.equal(qgemv.qlinear(x, qw, b, activations), ref)
    assert calls == [1, 4, 16, 17, 40]
    fresh_choice.setattr(qgemv, "CHUNKED_MAX_ROWS", 32)  # beyond it: dequantized blocks, no kernel call
    calls.clear()
    _assert_within(qgemv.qlinear(xs[4], qw, b, activations), xs[4], qw, b, "fp32")
    assert calls == []
    xg = torch.randn(2, 128, requires_grad=True)
    qgemv.qlinear(xg, qw, b, activations).sum().backward()
    assert xg.grad is not None and calls == []
    x16 = xs[1].bfloat16()
    y16 = qgemv.qlinear(x16, qw, b, activations)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, real(qgemv.loaded_library(), x16.float(), qw, b, 4, activations).bfloat16())
    with pytest.raises(ValueError, match="does not fit the quantized weight"):
        qgemv.qlinear(torch.randn(2, 127), qw)


@pytest.mark.parametrize("activations", qgemv.ACTIVATIONS)
def test_torch_fallback(fresh_choice, activations):
    """OMNILAB_CPU_QGEMV=torch: dequantize + F.linear (fp32) or the integer-activation reference, the kernel's
    result up to fp32 rounding."""
    x, qw, b = _data(5, 96, 256, "int4", 32, True)
    with qgemv.use_qgemv("torch"):
        got = qgemv.qlinear(x, qw, b, activations)
    if activations == "fp32":
        assert torch.equal(got, F.linear(x, qw.dequantize(), b))
    else:
        assert torch.equal(got, quant.int_act_reference(x, qw, 16 if activations == "int16" else 8) + b)
    _assert_within(got, x, qw, b, activations)
    kernel = qgemv.qlinear(x, qw, b, activations)
    torch.testing.assert_close(got, kernel, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- choice rules (as tests/kernels/test_choice.py)
def test_bad_mode_names_accepted_values(fresh_choice):
    fresh_choice.setenv(qgemv.ENV, " Fast")
    accepted = "auto, omnilab, omnilab-avx512, omnilab-avx2, torch"
    with pytest.raises(ConfigError, match=f"{qgemv.ENV}=' Fast'.*{accepted}") as err:
        qgemv.qgemv_choice()
    assert isinstance(err.value, ValueError)


def test_missing_compiler(fresh_choice, tmp_path):
    fresh_choice.setenv("CXX", str(tmp_path / "no-such-compiler"))
    fresh_choice.setenv("OMNILAB_CACHE", str(tmp_path))
    with pytest.warns(RuntimeWarning, match=re.escape("no C++ compiler found")):
        c = qgemv.qgemv_choice()
    assert c.mode == "torch" and "no C++ compiler" in c.reason
    x, qw, _ = _data(3, 40, 64, "int8", None)
    assert torch.equal(qgemv.qlinear(x, qw, activations="fp32"), F.linear(x, qw.dequantize()))
    qgemv.reset()
    fresh_choice.setenv(qgemv.ENV, "omnilab")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found .*no-such-compiler"):
        qgemv.qgemv_choice()


def test_isa_rules():
    with pytest.raises(RuntimeError, match=f"{qgemv.ENV}=omnilab-avx512 needs a CPU with avx512"):
        qgemv.resolve(env="omnilab-avx512", flags=frozenset({"avx2", "fma"}))
    with pytest.raises(RuntimeError, match="needs a CPU with avx512f and avx512_vnni"):
        qgemv.resolve(env="omnilab-avx512", flags=frozenset({"avx512f", "avx2", "fma"}))
    with pytest.raises(RuntimeError, match="needs avx512f or avx2"):
        qgemv.resolve(env="omnilab", flags=frozenset({"sse4_2"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c, lib = qgemv.resolve(env="auto", flags=frozenset({"sse4_2"}))
    assert c.mode == "torch" and lib is None and "neither" in c.reason
    c, lib = qgemv.resolve(env="auto", flags=frozenset({"avx512f", "avx2", "fma"}))
    assert c.isa == "avx2" and lib.isa == "avx2" and "without avx512_vnni" in c.reason
    if "avx512" in QISAS:
        c, lib = qgemv.resolve(env="auto", flags=frozenset({"avx512f", "avx512_vnni", "avx512bw", "avx2", "fma"}))
        assert c.isa == lib.isa == "avx512" and "vpdpbusd" in c.reason
        c, lib = qgemv.resolve(env="auto", flags=frozenset({"avx512f", "avx512_vnni", "avx2", "fma"}))
        assert c.isa == lib.isa == "avx2" and "without avx512_vnni or avx512bw" in c.reason


def test_env_torch_and_switching_for_a_block(fresh_choice):
    fresh_choice.setenv(qgemv.ENV, "torch")
    c = qgemv.qgemv_choice()
    assert c.mode == "torch" and c.source == "env" and qgemv.ENV in c.reason and c.label == "torch"
    with qgemv.use_qgemv("omnilab") as inside:
        assert inside.mode == "omnilab" and inside.source == "argument" and qgemv.qgemv_choice() is inside
        assert inside.label.endswith("for 1-16 rows")
    assert qgemv.qgemv_choice() is c


@pytest.mark.parametrize("activations", qgemv.ACTIVATIONS)
@pytest.mark.parametrize("gs", [32, 128])
def test_fp16_and_fp32_scales_give_the_same_bits(lib, activations, gs):
    """int4 scales stored as fp16 (what the quantizers make) are widened exactly on load: the same values stored as
    fp32 (a file's scales fp16 cannot hold) give bitwise the same result, on every build this CPU runs."""
    x, qw, b = _data(5, 2050, 256, "int4", gs, True)
    assert qw.scales.dtype == torch.float16
    wide = quant.QuantizedWeight(qw.method, qw.group_size, qw.shape, qw.qweight, qw.scales.float().contiguous())
    assert wide.nbytes == qw.nbytes + qw.scales.numel() * 2
    for rows in (1, 5):
        assert torch.equal(qgemv.qgemv_rows(x[:rows], qw, b, lib=lib, activations=activations),
                           qgemv.qgemv_rows(x[:rows], wide, b, lib=lib, activations=activations))
