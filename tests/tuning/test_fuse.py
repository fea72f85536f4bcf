"""Fused decode projections (q/k/v, gate/up in one kernel call): bitwise the separate calls wherever they are
taken, never held twice, rebuilt when weights change, off where a torch GEMM would compute them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omnilab.errors import ConfigError
from omnilab.kernels import gemv, linear, qgemv
from omnilab.kernels.quant import QuantizedWeight, quantize
from omnilab.models.layers import Linear
from omnilab.tuning import fuse

from _kernel_common import skip_without_isa  # noqa: E402

skip_without_isa()


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    for m in (gemv, qgemv):
        monkeypatch.delenv(m.ENV, raising=False)
        m.reset()
    monkeypatch.delenv(fuse.ENV, raising=False)
    assert gemv.loaded_library() is not None and qgemv.loaded_library() is not None
    yield
    for m in (gemv, qgemv):
        m.reset()


def _linears(storage: str, sizes=(64, 32, 32), k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    mods = []
    for i, n in enumerate(sizes):
        m = Linear(k, n, bias=False).requires_grad_(False)
        w = torch.randn(n, k, generator=g) * 0.05
        if storage in ("int8", "int4"):
            del m._parameters["weight"]
            m.weight = quantize(w, storage, 32 if storage == "int4" else None)
        else:
            m.weight.data = w.to(torch.bfloat16 if storage == "bf16" else torch.float32)
        mods.append(m)
    return mods


CASES = [("bf16", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.float32), ("int4", torch.float32)]


@pytest.mark.parametrize("storage,xdtype", CASES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_fused_outputs_equal_the_separate_calls_bitwise(storage, xdtype, rows):
    mods = _linears(storage)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1)).to(xdtype)
    with torch.inference_mode():
        separate = [linear(x, m.weight) for m in mods]
        proj = fuse.FusedProjection()
        fused = proj(x, mods)
    assert fused is not None, "the decode kernels take this call: it must be fused"
    for a, b in zip(fused, separate):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("storage", ["bf16", "int4"])
def test_the_separate_weights_become_rows_of_the_fused_matrix(storage):
    """Nothing is held twice: after fusing, each linear's weight is a slice of the fused storage, and prefill-size
    inputs (the separate path) still compute the same values from those slices."""
    mods = _linears(storage)
    before = [m.weight.dequantize() if storage == "int4" else m.weight.clone() for m in mods]
    proj = fuse.FusedProjection()
    fused = proj.get(mods)
    base = fused.qweight if isinstance(fused, QuantizedWeight) else fused
    for m, old in zip(mods, before):
        t = m.weight.qweight if isinstance(m.weight, QuantizedWeight) else m.weight
        assert t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        now = m.weight.dequantize() if storage == "int4" else m.weight
        assert torch.equal(now, old)


def test_calls_torch_would_compute_are_not_fused(monkeypatch):
    """fp32 matrices (MKL at 1-3 rows), prefills (more than 16 rows) and OMNILAB_FUSE_PROJECTIONS=off keep the
    separate linears, so their numerics do not change."""
    proj = fuse.FusedProjection()
    assert proj(torch.randn(1, 128), _linears("fp32")) is None
    assert proj(torch.randn(17, 128), _linears("bf16")) is None
    monkeypatch.setenv(fuse.ENV, "off")
    assert proj(torch.randn(1, 128), _linears("bf16")) is None
    monkeypatch.setenv(fuse.ENV, "sometimes")
    with pytest.raises(ConfigError, match="OMNILAB_FUSE_PROJECTIONS='sometimes'.*accepted: auto, off"):
        proj(torch.randn(1, 128), _linears("bf16"))


def test_a_replaced_weight_rebuilds_the_fused_matrix():
    mods = _linears("bf16")
    proj = fuse.FusedProjection()
    x = torch.randn(1, 128)
    with torch.inference_mode():
        proj(x, mods)
        mods[1].weight = torch.nn.Parameter(torch.ones(32, 128, dtype=torch.bfloat16), requires_grad=False)
        out = proj(x, mods)
    assert torch.equal(out[1], linear(x, mods[1].weight))


@pytest.mark.parametrize("quantization", [None, pytest.param("int4", marks=pytest.mark.slow)])
def test_greedy_codes_do_not_change_with_fusion(tiny_ckpt, monkeypatch, quantization):
    """The user's path (eager pipeline, greedy): the same codes with the fused calls as without."""
    from omnilab.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32",
                                    quantization=quantization)
    try:
        got = {}
        for mode in ("off", "auto"):
            monkeypatch.setenv(fuse.ENV, mode)
            r = pipe.generate("Fused or not, the same codes.", speaker="vivian", do_sample=False,
                              subtalker_do_sample=False, max_new_tokens=12)
            got[mode] = np.asarray(r.codes)
        assert np.array_equal(got["off"], got["auto"])
        attn = pipe.model.talker.model.layers[0].self_attn
        assert attn._qkv._fused is not None  # the fused path really ran
    finally:
        pipe.close()
