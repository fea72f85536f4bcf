"""omnilab's RMSNorm kernel: accuracy against the reference's ops, row/thread independence, per-head weights,
dispatch and the choice variable."""
from __future__ import annotations

import pytest
import torch

from omnilab.errors import ConfigError
from omnilab.kernels import norm
from omnilab.models.layers import RMSNorm

from _kernel_common import fixtures, skip_without_isa  # noqa: E402

skip_without_isa()
lib, fresh_choice = fixtures(norm, "norm")


def _call(lib, x, w, eps=1e-6):
    """The kernel on ``lib`` (one ISA build), bypassing the process choice."""
    slot = norm._SLOT
    saved = slot.choice, slot.lib
    slot.choice, slot.lib = "test", lib
    try:
        return norm.rms_norm(x, w, eps)
    finally:
        slot.choice, slot.lib = saved


def _data(shape, wshape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype), (torch.randn(*wshape, generator=g) + 1).to(dtype)


SHAPES = [((1, 1, 1024), (1024,)), ((3, 5, 1024), (1024,)), ((1, 1, 24, 128), (24, 128)),
          ((2, 3, 24, 128), (24, 128)), ((7, 100), (100,)), ((1, 1, 17), (17,)), ((4, 3), (3,))]


@pytest.mark.parametrize("shape,wshape", SHAPES)
def test_fp32_matches_the_reference_to_fp32_rounding(lib, shape, wshape):
    """Only the mean's summation order differs from torch's ops: the scale is within a few ulp, so every element is
    within 4 ulp of the reference's (2 roundings of the scale's error, 2 of the products)."""
    x, w = _data(shape, wshape, torch.float32)
    got, ref = _call(lib, x, w), norm.rms_norm_torch(x, w, 1e-6)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert ((got - ref).abs() <= 4 * torch.finfo(torch.float32).eps * ref.abs() + 1e-30).all()


@pytest.mark.parametrize("shape,wshape", SHAPES)
def test_bf16_matches_the_reference_within_one_bf16_step(lib, shape, wshape):
    """bf16 rows: h is rounded to bf16 and then multiplied by the weight in bf16, as the reference does; the fp32
    scale's few-ulp difference can move a value across a bf16 rounding boundary (one bf16 step, 2^-8 relative) and
    no more."""
    x, w = _data(shape, wshape, torch.bfloat16)
    got, ref = _call(lib, x, w), norm.rms_norm_torch(x, w, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    step = 2.0 ** -7 * ref.float().abs()  # one bf16 ulp of the result, twice over (two roundings)
    assert ((got.float() - ref.float()).abs() <= step + 1e-30).all()


def test_a_row_does_not_depend_on_its_batch_mates_or_the_thread_count(lib):
    x, w = _data((64, 3, 1024), (1024,), torch.float32)  # 64 * 3 * 1024 elements: threaded in the kernel
    whole = _call(lib, x, w)
    for i in (0, 17, 63):
        assert torch.equal(_call(lib, x[i:i + 1].contiguous(), w), whole[i:i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_call(lib, x, w), whole)
    finally:
        torch.set_num_threads(threads)


def test_per_head_weights_apply_to_each_head(lib):
    """[..., H, D] with [H, D]: head h uses weight row h (the stacked q/k norms of the decoder)."""
    x, w = _data((2, 3, 6, 32), (6, 32), torch.float32)
    got = _call(lib, x, w)
    for h in range(6):
        torch.testing.assert_close(got[..., h, :], norm.rms_norm_torch(x[..., h, :], w[h], 1e-6), rtol=5e-7, atol=0)


def test_dispatch_falls_back_to_the_reference_where_the_kernel_does_not_apply(fresh_choice):
    """Float64, mixed dtypes, broadcasting the kernel does not do and autograd inputs take torch's ops (the same
    result where both apply, gradients flow)."""
    assert norm.norm_choice().mode == "omnilab"
    calls = []
    real = norm.rms_norm_torch
    fresh_choice.setattr(norm, "rms_norm_torch", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w = _data((2, 8), (8,), torch.float32)
    norm.rms_norm(x, w, 1e-6)
    norm.rms_norm(x.t().contiguous().t(), w, 1e-6)  # non-contiguous: copied, still the kernel
    assert calls == []
    norm.rms_norm(x.double(), w.double(), 1e-6)
    norm.rms_norm(x, w.bfloat16(), 1e-6)
    norm.rms_norm(x, torch.ones(2, 1), 1e-6)  # broadcast over D: torch
    xg = x.clone().requires_grad_()
    norm.rms_norm(xg, w, 1e-6).sum().backward()
    assert xg.grad is not None and len(calls) == 4


def test_the_module_uses_the_choice_and_torch_under_the_override(fresh_choice):
    m = RMSNorm(16)
    torch.nn.init.normal_(m.weight, 1, 0.2)
    x = _data((3, 16), (16,), torch.float32)[0]
    with torch.no_grad():
        fast = m(x)
        assert norm.norm_choice().mode == "omnilab"
        norm.reset()
        fresh_choice.setenv(norm.ENV, "torch")
        plain = m(x)
    assert norm.norm_choice().mode == "torch" and norm.ENV in norm.norm_choice().reason
    torch.testing.assert_close(fast, plain, rtol=5e-7, atol=0)


def test_a_bad_mode_names_the_accepted_ones(fresh_choice):
    fresh_choice.setenv(norm.ENV, "fastest")
    with pytest.raises(ConfigError, match="OMNILAB_CPU_NORM='fastest'.*accepted: auto"):
        norm.norm_choice()


def test_an_edited_shared_header_rebuilds_the_kernels_that_include_it(tmp_path, monkeypatch):
    """norm.cpp and attn.cpp include simd.h: the library name hashes the header too, so an edit there is a new
    build rather than a stale cached library."""
    import shutil

    from omnilab.kernels import build

    for f in ("norm.cpp", "simd.h"):
        shutil.copy(build.SOURCE_DIR / f, tmp_path / f)
    cxx = build.find_compiler() or "g++"
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    before = build.library_path("norm", "avx2", cxx, cache=tmp_path)
    (tmp_path / "simd.h").write_text((tmp_path / "simd.h").read_text() + "\n// edited\n")
    assert build.library_path("norm", "avx2", cxx, cache=tmp_path) != before
