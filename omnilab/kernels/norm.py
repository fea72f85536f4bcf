"""RMSNorm of the decoder stacks in one kernel call: ``rms_norm(x, weight, eps)``.

Why: a decode frame of the 0.6B model runs ~325 RMSNorms over a single row ([1, 1024]) or a few stacked heads
([24, 128]); torch spends ~8 ops on each (cast, pow, mean, add, rsqrt, mul, cast, mul), about 20-40 us per norm on
2 shared cores, 7-13 ms per frame. ``norm.cpp`` computes the same formula in one pass per row.

Numerics (``norm.cpp``): fp32 statistics, ``h = x * rsqrt(mean(x^2) + eps)`` rounded to the input dtype, then
``weight * h``, as the reference; only the summation order of the mean differs from torch's (fp32 rounding,
tests/kernels/test_norm.py bounds it). A row's result depends only on that row, so batch mates, thread counts
and streaming chunk sizes do not change it. Both backends call this same function (the eager decoder and vLLM's
talker stack and code predictor), so they stay equal to each other.

Choice, resolved once per process (:func:`norm_choice`), with a reason; ``OMNILAB_CPU_NORM`` overrides:
``auto`` (default: the kernel for the CPU's widest ISA if a C++ compiler builds it, else torch with a warning),
``omnilab`` / ``omnilab-avx512`` / ``omnilab-avx2`` (the kernel, or an error), ``torch`` (the reference's ops).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from omnilab.kernels.choice import KERNEL_MODES, KernelSlot, resolve_kernel
from omnilab.kernels.trust import open_library, symbol

ENV = "OMNILAB_CPU_NORM"
MODES = KERNEL_MODES
MAX_BF16_DIM = 4096  # norm.cpp's bf16 row buffer
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class NormChoice:
    """Which implementation :func:`rms_norm` uses, and why."""

    mode: str             # "omnilab" | "torch"
    isa: str | None
    library: str | None
    reason: str
    source: str           # "auto" | "env" | "argument" (use_norm)

    @property
    def label(self) -> str:
        return f"omnilab-{self.isa} (one call per norm)" if self.mode == "omnilab" else "torch (8 ops per norm)"

    def __repr__(self) -> str:
        return f"NormChoice({self.label!r}, source={self.source!r})"


class _Lib:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.lib = open_library(self.path)  # checked first (kernels/trust.py); a missing symbol: KernelBuildError
        fn = symbol(self.lib, "omnilab_rmsnorm", path)
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        self.fn = fn
        isa = symbol(self.lib, "omnilab_norm_isa", path)
        isa.restype = ctypes.c_char_p
        self.isa = isa().decode()


def resolve(env: str | None = None, flags: frozenset[str] | None = None) -> tuple[NormChoice, _Lib | None]:
    """Decide (and build) without installing the result; :func:`norm_choice` caches it per process."""
    lib, reason, source = resolve_kernel(ENV, "RMSNorm", "norm", _Lib, "torch's ops (8 per norm)", env, flags)
    if lib is None:
        return NormChoice("torch", None, None, reason, source), None
    return NormChoice("omnilab", lib.isa, str(lib.path), f"{reason}; one call per norm instead of 8 torch ops",
                      source), lib


_SLOT = KernelSlot(resolve)


def norm_choice() -> NormChoice:
    """The process's RMSNorm choice (resolved, and the kernel built, on first use)."""
    return _SLOT.get()


def reset() -> None:
    """Forget the choice (tests; a changed ``OMNILAB_CPU_NORM`` takes effect on the next call)."""
    _SLOT.reset()


def use_norm(mode: str):
    """Within the block (``with use_norm(mode):``) this process's :func:`rms_norm` uses ``mode`` (one of
    :data:`MODES`), e.g. to time torch's ops against the kernel on one loaded model."""
    return _SLOT.use(mode)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference's ops (transformers Qwen3RMSNorm): fp32 statistics, the weight applied after the cast back."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` [..., D] with ``weight`` [D], or ``weight`` [H, D] for ``x`` [..., H, D] (one weight per head) -> like ``x``.

    The kernel takes contiguous fp32 or bf16 CPU tensors of one dtype outside autograd and torch.compile;
    anything else runs :func:`rms_norm_torch`."""
    lib = _SLOT.loaded()
    d = x.shape[-1] if x.dim() else 0
    code = _DTYPES.get(x.dtype)
    if (lib is None or code is None or weight.dtype != x.dtype or d == 0 or torch.compiler.is_compiling()
            or x.device.type != "cpu" or weight.device.type != "cpu"
            or (code == 1 and d > MAX_BF16_DIM)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return rms_norm_torch(x, weight, eps)
    rows = x.numel() // d
    if weight.dim() > x.dim() or tuple(x.shape[x.dim() - weight.dim():]) != tuple(weight.shape):
        return rms_norm_torch(x, weight, eps)  # broadcasting the kernel does not do (torch says if it is wrong)
    w_rows = weight.numel() // d  # row r of x uses weight row r % w_rows (weight: x's trailing dims)
    xc = x if x.is_contiguous() else x.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    y = torch.empty_like(xc)
    if lib.fn(xc.data_ptr(), w.data_ptr(), y.data_ptr(), rows, d, w_rows, float(eps), code, torch.get_num_threads()):
        raise RuntimeError(f"omnilab_rmsnorm rejected x {tuple(x.shape)} with weight {tuple(weight.shape)}")
    return y
