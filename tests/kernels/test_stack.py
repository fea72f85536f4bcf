"""omnilab's decode-stack library: its SwiGLU against torch's, row and thread independence, the MLP's dispatch and
the choice variable. (The one-call stack step is bitwise the per-layer steps: tests/models/test_decode_step.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnilab.errors import ConfigError
from omnilab.kernels import stack

from _kernel_common import fixtures, skip_without_isa  # noqa: E402

skip_without_isa()
lib, fresh_choice = fixtures(stack, "stack")


def _call(lib, gu, inter):
    """The kernel on ``lib`` (one ISA build), bypassing the process choice."""
    slot = stack._SLOT
    saved = slot.choice, slot.lib
    slot.choice, slot.lib = "test", lib
    try:
        return stack.swiglu(gu, inter)
    finally:
        slot.choice, slot.lib = saved


@pytest.mark.parametrize("shape,inter", [((1, 1, 6144), 3072), ((3, 1, 6144), 3072), ((2, 7, 64), 32),
                                         ((1, 1, 34), 17), ((5, 2), 1)])
def test_swiglu_matches_torch_within_a_few_ulp(lib, shape, inter):
    """torch's formula g / (1 + exp(-g)) then * u, with another expf (glibc's; torch's is Sleef's): each
    implementation's result is within 2.5 eps relative of the exact value (exp within 1 ulp <= eps relative, then
    three roundings of eps/2: the sum, the division, the product), so the two are within 5 eps of each other (a
    tail shorter than the vector width goes through the same lanes). Measured: at most ~3 eps."""
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(*shape, generator=g) * 4
    got = _call(lib, gu, inter)
    ref = F.silu(gu[..., :inter]) * gu[..., inter:]
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert ((got - ref).abs() <= 5 * torch.finfo(torch.float32).eps * ref.abs() + 1e-37).all()


@pytest.mark.parametrize("shape,inter", [((1, 1, 6144), 3072), ((3, 1, 6144), 3072), ((1, 1, 34), 17)])
def test_bf16_swiglu_rounds_as_torchs_bf16_ops(lib, shape, inter):
    """bf16 rows: rnd(rnd(silu(g)) * u) with silu in fp32. torch's bf16 F.silu also computes in fp32 and rounds, so
    the two silu values differ by at most 1 bf16 step where the fp32 values (within 5 eps) straddle a rounding
    boundary, and the product then by at most 1 step more: within 2 bf16 steps (2 * 2^-8 relative); and bitwise
    the bf16 rounding of the kernel's own fp32 silu (the computed reference below)."""
    g = torch.Generator().manual_seed(2)
    gu = (torch.randn(*shape, generator=g) * 4).bfloat16()
    got = _call(lib, gu, inter)
    assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], inter)
    ref = F.silu(gu[..., :inter]) * gu[..., inter:]
    step = 2.0 ** -8
    assert ((got.float() - ref.float()).abs() <= 2 * step * ref.float().abs() + 1e-30).all()
    silu32 = _call(lib, torch.cat([gu[..., :inter].float(), torch.ones_like(gu[..., inter:].float())], -1), inter)
    own = (silu32.bfloat16().float() * gu[..., inter:].float()).bfloat16()
    assert torch.equal(got, own)


def test_swiglu_extremes(lib):
    """Large |g|: silu(g) -> g for g >> 0 and -> -0 (not NaN) for g << 0; infinities and NaN propagate as torch's."""
    gate = torch.tensor([[-1e4, -100.0, -88.0, 0.0, 88.0, 100.0, 1e4, float("nan")]])
    up = torch.full_like(gate, 2.0)
    got = _call(lib, torch.cat([gate, up], dim=-1), gate.shape[-1])
    ref = F.silu(gate) * up
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert torch.allclose(got[ok], ref[ok], rtol=4e-7, atol=0.0)


def test_a_row_does_not_depend_on_its_batch_mates(lib):
    g = torch.Generator().manual_seed(1)
    gu = torch.randn(6, 1, 2 * 3072, generator=g)
    together = _call(lib, gu, 3072)
    alone = torch.cat([_call(lib, gu[i:i + 1].contiguous(), 3072) for i in range(6)])
    assert torch.equal(together, alone)


def test_the_mlp_uses_it_on_both_of_its_paths(lib, monkeypatch):
    """SwiGLU.forward: the fused gate/up output and the separate matrices give the same activation (the decode
    step and the general path stay bitwise equal to each other)."""
    from omnilab.models.layers import SwiGLU
    from omnilab.tuning import fuse

    torch.manual_seed(0)
    mlp = SwiGLU(64, 96)
    with torch.no_grad():
        for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            m.weight.data = m.weight.data.to(torch.bfloat16)  # bf16 storage: the decode kernels take it
    x = torch.randn(1, 1, 64)
    slot = stack._SLOT
    saved = slot.choice, slot.lib
    slot.choice, slot.lib = "test", lib
    try:
        with torch.inference_mode():
            fused = mlp.forward(x)
            monkeypatch.setenv(fuse.ENV, "off")
            separate = mlp.forward(x)
    finally:
        slot.choice, slot.lib = saved
    assert torch.equal(fused, separate)


def test_choice_and_the_torch_mode(fresh_choice):
    c = stack.stack_choice()
    assert c.mode == "omnilab" and c.isa in ("avx512", "avx2") and "one call per decoder step" in c.reason
    fresh_choice.setenv(stack.ENV, "torch")
    stack.reset()
    assert stack.stack_choice().mode == "torch" and stack.loaded_library() is None
    gu = torch.randn(2, 8)
    assert torch.equal(stack.swiglu(gu, 4), F.silu(gu[..., :4]) * gu[..., 4:])


def test_a_bad_mode_names_the_accepted_ones(fresh_choice):
    fresh_choice.setenv(stack.ENV, "fast")
    with pytest.raises(ConfigError, match="OMNILAB_CPU_STACK='fast'.*accepted: auto, omnilab, omnilab-avx512, "
                                          "omnilab-avx2, torch"):
        stack.stack_choice()
