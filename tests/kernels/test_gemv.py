"""omnilab's small-batch GEMV kernel: numerics, batch invariance, dispatch rules (choice rules: test_choice.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnilab.kernels import build, gemv
from omnilab.kernels.build import build_library

from _kernel_common import ISAS, fixtures, skip_without_isa  # noqa: E402

skip_without_isa()
lib, fresh_choice = fixtures(gemv, "gemv")


def _data(rows, n, k, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("n,k", [(1024, 1024), (37, 70), (3, 5), (2050, 24)])  # tails in N and in K
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_f_linear(lib, rows, n, k, bias):
    x, w, b = _data(rows, n, k, bias)
    torch.testing.assert_close(gemv.gemv_rows(x, w, b, lib=lib), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n, k, bias", [(3072, 1024, False), (37, 1030, True)])  # 1030: a scalar tail after the lanes
def test_rows_do_not_depend_on_batch_or_threads(lib, n, k, bias):
    """A row's result is bitwise the same alone (the kernel's one-row loop), among 1..8 rows (its row blocks), and
    with 1 or 2 threads."""
    x, w, b = _data(8, n, k, bias)
    alone = torch.cat([gemv.gemv_rows(x[i:i + 1], w, b, lib=lib) for i in range(8)])
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for m in range(1, 9):
                assert torch.equal(gemv.gemv_rows(x[:m], w, b, lib=lib), alone[:m]), (m, nt)
    finally:
        torch.set_num_threads(threads)


def test_input_layouts(lib):
    """3-D inputs, strided inputs (a slice of a sequence) and a non-contiguous weight give F.linear's answer."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, generator=g)
    w = torch.randn(64, 48, generator=g).t()  # [48, 64], non-contiguous
    torch.testing.assert_close(gemv.gemv_rows(x, w, lib=lib), F.linear(x, w), rtol=1e-5, atol=1e-5)
    seq = torch.randn(4, 5, 64, generator=g)
    torch.testing.assert_close(gemv.gemv_rows(seq[:, -1], w, lib=lib), F.linear(seq[:, -1], w), rtol=1e-5, atol=1e-5)


def test_gemv_rows_rejects_what_it_cannot_do(lib):
    w = torch.randn(16, 32)
    with pytest.raises(ValueError, match="1..8 rows with torch.float32 weights, got 9"):
        gemv.gemv_rows(torch.randn(9, 32), w, lib=lib)
    with pytest.raises(ValueError, match="1..16 rows with torch.bfloat16 weights, got 17"):
        gemv.gemv_rows(torch.randn(17, 32), w.bfloat16(), lib=lib)
    with pytest.raises(TypeError, match="float32"):
        gemv.gemv_rows(torch.randn(2, 32, dtype=torch.bfloat16), w.bfloat16(), lib=lib)
    with pytest.raises(ValueError, match="shapes do not fit"):
        gemv.gemv_rows(torch.randn(2, 31), w, lib=lib)


@pytest.mark.parametrize("n,k", [(1024, 1024), (37, 70), (2050, 24)])
def test_bf16_weights_are_the_fp32_kernel_on_the_exact_copy(lib, n, k):
    """bf16-stored weights expand exactly: the result is bitwise the fp32 kernel's on ``w.float()`` (same
    summation order), for 1..16 rows (two 8-row passes), and close to F.linear."""
    x, w, b = _data(16, n, k, True)
    w16 = w.bfloat16()
    got = gemv.gemv_rows(x, w16, b, lib=lib)
    want = torch.cat([gemv.gemv_rows(x[:8], w16.float(), b, lib=lib), gemv.gemv_rows(x[8:], w16.float(), b, lib=lib)])
    assert torch.equal(got, want)
    torch.testing.assert_close(got, F.linear(x, w16.float(), b), rtol=1e-5, atol=1e-5)


def test_bf16_weight_rows_do_not_depend_on_batch_or_threads(lib):
    x, w, _ = _data(16, 1024, 3072, False)
    w16 = w.bfloat16()
    alone = torch.cat([gemv.gemv_rows(x[i:i + 1], w16, lib=lib) for i in range(16)])
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for m in (1, 2, 5, 8, 9, 13, 16):
                assert torch.equal(gemv.gemv_rows(x[:m], w16, lib=lib), alone[:m]), (m, nt)
    finally:
        torch.set_num_threads(threads)


def test_linear_over_bf16_weights(fresh_choice):
    """fp32 inputs over bf16 weights: the kernel for 1..16 rows; more rows and autograd compute F.linear on
    the exact fp32 copy; a bf16 bias is upcast; bf16 inputs stay torch's bf16 linear."""
    gemv.gemv_choice()
    g = torch.Generator().manual_seed(3)
    w16 = (torch.randn(96, 64, generator=g) / 8).bfloat16()
    b16 = torch.randn(96, generator=g).bfloat16()
    xs = [torch.randn(rows, 64, generator=g) for rows in (1, 3, 8, 16, 17, 40)]
    want = [gemv.gemv_rows(x, w16, b16.float()) if len(x) <= 16 else F.linear(x, w16.float(), b16.float())
            for x in xs]
    calls = []
    real = gemv._call
    fresh_choice.setattr(gemv, "_call", lambda *a: calls.append(a[-1]) or real(*a))
    for x, ref in zip(xs, want):
        assert torch.equal(gemv.linear(x, w16, b16), ref), len(x)
    assert calls == [1, 3, 8, 16]
    x = torch.randn(2, 64, generator=g)
    xg = torch.randn(2, 64, requires_grad=True)
    gemv.linear(xg, w16).sum().backward()
    assert xg.grad is not None
    assert gemv.linear(x.bfloat16(), w16).dtype == torch.bfloat16


@pytest.mark.slow
def test_compiled_linear_over_bf16_weights_calls_the_same_code(fresh_choice):
    """Under torch.compile the bf16-weight linear is one opaque op: bitwise the eager result (no per-call
    conversion of the matrix inside the graph), for kernel-sized and prefill-sized inputs."""
    gemv.gemv_choice()
    g = torch.Generator().manual_seed(4)
    w16, b = (torch.randn(96, 64, generator=g) / 8).bfloat16(), torch.randn(96, generator=g)

    def mlp(x):
        return F.silu(gemv.linear(x, w16, b)) * 2

    compiled = torch.compile(mlp, dynamic=True)
    for rows in (3, 40):
        x = torch.randn(rows, 64, generator=g)
        assert torch.equal(compiled(x), mlp(x)), rows


def test_linear_dispatch_by_rows_dtype_and_autograd(fresh_choice):
    choice = gemv.gemv_choice()
    assert choice.mode == "omnilab" and (choice.min_rows, choice.max_rows) == (4, 8)
    w = torch.randn(96, 64)
    xs = [torch.randn(rows, 64) for rows in range(1, 12)]
    kernel = [gemv.gemv_rows(x, w) if len(x) <= 8 else None for x in xs]
    calls = []
    real = gemv._call
    fresh_choice.setattr(gemv, "_call", lambda *a: calls.append(a[-1]) or real(*a))
    for x, ref in zip(xs, kernel):
        got = gemv.linear(x, w)
        if 4 <= len(x) <= 8:
            assert torch.equal(got, ref)
        else:  # torch's own result, bit for bit (single-stream numerics stay the reference's)
            assert torch.equal(got, F.linear(x, w))
    assert calls == [4, 5, 6, 7, 8]
    xb = torch.randn(4, 64, dtype=torch.bfloat16)  # bf16 compute: the kernel on the widened rows, rounded once
    assert torch.equal(gemv.linear(xb, w.bfloat16()), gemv.gemv_rows(xb.float(), w.bfloat16()).bfloat16())
    assert calls == [4, 5, 6, 7, 8, 4, 4]
    with pytest.raises(RuntimeError):  # a shape mismatch is torch's error, never a read past the weight
        gemv.linear(torch.randn(4, 65), w)
    wt, x4 = torch.randn(64, 96).t(), torch.randn(4, 64)  # non-contiguous weight: torch, not a copy per call
    assert torch.equal(gemv.linear(x4, wt), F.linear(x4, wt))
    wg = torch.randn(96, 64, requires_grad=True)
    gemv.linear(torch.randn(4, 64), wg).sum().backward()  # autograd goes through torch
    assert wg.grad is not None and calls == [4, 5, 6, 7, 8, 4, 4]


def test_use_gemv_switches_linear(fresh_choice):
    """``use_gemv`` switches what :func:`linear` runs: torch's op, then the kernel (choice rules: test_choice)."""
    x, w, _ = _data(4, 256, 128, False)
    with gemv.use_gemv("torch"):
        assert torch.equal(gemv.linear(x, w), F.linear(x, w))
    with gemv.use_gemv("omnilab"):
        assert torch.equal(gemv.linear(x, w), gemv.gemv_rows(x, w, lib=gemv.loaded_library()))

def test_build_is_cached_per_source_and_compiler(tmp_path):
    a = build_library("gemv", ISAS[-1], cache=tmp_path)
    mtime = a.stat().st_mtime_ns
    assert build_library("gemv", ISAS[-1], cache=tmp_path) == a and a.stat().st_mtime_ns == mtime
    assert a.name.startswith(f"gemv-{ISAS[-1]}-") and a.suffix == ".so"
    with pytest.raises(ValueError, match="unknown ISA 'sse'; accepted: avx512, avx2"):
        build.library_path("gemv", "sse", "g++")


@pytest.mark.parametrize("isa", ISAS)
def test_one_openmp_runtime_in_the_process(isa):
    """The kernel's OpenMP calls go to the runtime torch loaded (same soname), not a second thread pool.

    Checked in a fresh process holding only torch and the kernel: this test process may also hold other
    packages' privately renamed OpenMP copies (e.g. sentencepiece's ``libgomp-<hash>.so``, loaded by vLLM),
    which the kernel cannot bind to (other soname) and which say nothing about the kernel."""
    import subprocess
    import sys

    code = (f"import torch, torch.nn.functional\n"
            f"from omnilab.kernels import gemv\n"
            f"from omnilab.kernels.build import build_library\n"
            f"lib = gemv._Lib(build_library('gemv', {isa!r}))\n"
            f"x, w = torch.randn(4, 64), torch.randn(32, 64)\n"
            f"gemv.gemv_rows(x, w, lib=lib)\n"
            f"maps = open('/proc/self/maps').read().split('\\n')\n"
            f"print(sorted({{l.split()[-1] for l in maps if ('libgomp' in l or 'libiomp' in l) and '/' in l}}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    omp = eval(out.stdout.strip().splitlines()[-1])
    assert len(omp) == 1, omp
