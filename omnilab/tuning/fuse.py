"""Fused decode projections: q/k/v as one matrix, gate/up as one matrix, read in one kernel call per decode step.

Why: a decode step calls a linear per matrix; at one row each call is a fixed cost besides the bytes (argument
checks, an output allocation, one OpenMP fork/join in the kernel) and the small k/v matrices (1024 x 1024) are
too short for the prefetcher to reach full speed. A layer's q, k and v read the same input, as do gate and up:
stacking their rows makes 2 calls of 5 per layer instead (0.6B: 737 -> 428 kernel calls per frame).

Numerics: the fused call is taken only where omnilab's kernels compute it (:func:`kernel_takes`: bf16-stored
weights with fp32 rows, bf16 compute on the kernel path, quantized weights; 1-16 rows). Each output of those
kernels is one row of the matrix dotted with the input in a fixed order that does not depend on the other rows
of the matrix (``gemv.cpp``, ``qgemv.cpp``), so the fused outputs equal the separate calls bit for bit
(tests/tuning/test_fuse.py). Anything else (torch's GEMMs: prefills, fp32 matrices at 1-3 rows) keeps the
separate matrices, so its numerics do not change either.

Memory: the fused matrix is built once (first decode call, or :func:`fuse_module`) and the separate weights are
re-pointed to row slices of it (``Parameter.data``; a :class:`QuantizedWeight` rebuilt over slices of the fused
codes and scales), so nothing is held twice. ``OMNILAB_FUSE_PROJECTIONS=auto|off`` (``off``: separate calls,
to measure the gain side by side).
"""
from __future__ import annotations

from typing import Sequence

import torch

from omnilab import settings
from omnilab.errors import ConfigError
from omnilab.kernels import gemv, qgemv
from omnilab.kernels.quant import ROWS, QuantizedWeight

ENV = "OMNILAB_FUSE_PROJECTIONS"
MODES = ("auto", "off")
MAX_ROWS = 16  # the kernels' decode rows (gemv BF16_MAX_ROWS, qgemv MAX_ROWS)

Weight = torch.Tensor | QuantizedWeight


def enabled() -> bool:
    given = settings.raw(ENV)
    raw = (given or "auto").strip().lower() or "auto"
    if raw not in MODES:
        raise ConfigError(f"{ENV}={given!r} is not a mode; accepted: {', '.join(MODES)}")
    return raw == "auto"


def kernel_takes(x: torch.Tensor, weight: Weight) -> bool:
    """Whether :func:`omnilab.kernels.linear` sends ``x`` over ``weight`` to one of omnilab's decode kernels
    (where a row's result is independent of the matrix's other rows)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 1 <= rows <= MAX_ROWS or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return False
    if isinstance(weight, QuantizedWeight):
        return qgemv.loaded_library() is not None and weight.shape[1] == k
    if weight.dtype != torch.bfloat16 or gemv.loaded_library() is None or weight.shape[1] != k:
        return False
    if x.dtype == torch.float32:
        return True
    return x.dtype == torch.bfloat16 and gemv._paths().bf16_decode == "kernel"


def _cat_quantized(parts: Sequence[QuantizedWeight]) -> QuantizedWeight | None:
    first = parts[0]
    if any((p.method, p.group_size, p.shape[1], p.activations) != (first.method, first.group_size, first.shape[1],
                                                                     first.activations) or p.shape[0] % ROWS
           for p in parts):
        return None  # padded rows inside the fused matrix would shift the outputs after them
    return QuantizedWeight(first.method, first.group_size, (sum(p.shape[0] for p in parts), first.shape[1]),
                           torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                           first.activations)


def _slice_quantized(fused: QuantizedWeight, lo: int, hi: int) -> QuantizedWeight:
    b0, b1 = lo // ROWS, hi // ROWS
    return QuantizedWeight(fused.method, fused.group_size, (hi - lo, fused.shape[1]), fused.qweight[b0:b1],
                           fused.scales[b0:b1], fused.activations)


def fuse(modules: Sequence[torch.nn.Module]) -> Weight | None:
    """Stack the ``weight`` of ``modules`` (linears without bias reading one input) into one matrix and re-point
    each module's weight to its rows of it. None when they cannot be fused (a bias, mixed storage, shapes)."""
    ws = [m.weight for m in modules]
    if any(getattr(m, "bias", None) is not None for m in modules):
        return None
    if all(isinstance(w, QuantizedWeight) for w in ws):
        fused = _cat_quantized(ws)
        if fused is None:
            return None
        lo = 0
        for m, w in zip(modules, ws):
            setattr(m, "weight", _slice_quantized(fused, lo, lo + w.shape[0]))
            lo += w.shape[0]
        return fused
    if not all(isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == ws[0].dtype and w.shape[1] == ws[0].shape[1]
               and w.device == ws[0].device for w in ws):
        return None
    with torch.no_grad():
        fused = torch.cat([w.detach() for w in ws])
        lo = 0
        for w in ws:
            w.data = fused[lo:lo + w.shape[0]]
            lo += w.shape[0]
    return fused


class FusedProjection:
    """The fused matrix of a group of linears (q/k/v or gate/up), rebuilt when their weights are replaced."""

    __slots__ = ("_key", "_fused", "sizes")

    def __init__(self):
        self._key = None
        self._fused = None
        self.sizes: tuple[int, ...] = ()

    @staticmethod
    def _identity(modules: Sequence[torch.nn.Module]) -> tuple:
        out = []
        for m in modules:
            w = m.weight
            out.append((id(w), w.qweight.data_ptr() if isinstance(w, QuantizedWeight) else w.data_ptr()))
        return tuple(out)

    def get(self, modules: Sequence[torch.nn.Module]) -> Weight | None:
        key = self._identity(modules)
        if key != self._key:
            self._fused = fuse(modules)
            self.sizes = tuple(m.weight.shape[0] for m in modules)
            self._key = self._identity(modules)  # after re-pointing
        return self._fused

    def output(self, x: torch.Tensor, modules: Sequence[torch.nn.Module]) -> torch.Tensor | None:
        """``x`` [..., K] -> the outputs of ``modules`` side by side [..., sum N] from one fused call, or None where
        the fused call would not be one of omnilab's kernels (the caller then calls each linear)."""
        if not enabled() or torch.compiler.is_compiling() or not kernel_takes(x, modules[0].weight):
            return None
        fused = self.get(modules)
        if fused is None:
            return None
        return gemv.linear(x, fused)

    def __call__(self, x: torch.Tensor, modules: Sequence[torch.nn.Module]) -> tuple[torch.Tensor, ...] | None:
        """The outputs of ``modules`` (views of :meth:`output`), or None (see there)."""
        y = self.output(x, modules)
        return None if y is None else y.split(self.sizes, dim=-1)
