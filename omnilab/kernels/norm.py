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

import torch

from omnilab.kernels.choice import KERNEL_MODES, KernelChoice, KernelLib, KernelSlot, resolve_simple

ENV = "OMNILAB_CPU_NORM"
MODES = KERNEL_MODES
MAX_BF16_DIM = 4096  # norm.cpp's bf16 row buffer
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ARGTYPES = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]


def _Lib(path) -> KernelLib:  # noqa: N802  (the kernel tests build one per ISA: tests/_kernel_common.py)
    return KernelLib(path, "omnilab_rmsnorm", "omnilab_norm_isa", ARGTYPES)


def resolve(env: str | None = None, flags: frozenset[str] | None = None) -> tuple[KernelChoice, KernelLib | None]:
    """Decide (and build) without installing the result; :func:`norm_choice` caches it per process."""
    return resolve_simple(ENV, "RMSNorm", "norm", _Lib,
                          "one call per norm instead of torch's 8 ops", "8 ops per norm", env, flags)


def launch(lib: KernelLib, xp: int, wp: int, yp: int, rows: int, d: int, w_rows: int, eps: float, code: int,
           threads: int) -> None:
    """The kernel on raw pointers (``rms_norm`` and the decode step call it): ``rows`` x ``d`` of dtype ``code``
    (0 fp32, 1 bf16), weight rows ``w_rows``."""
    if lib.fn(xp, wp, yp, rows, d, w_rows, float(eps), code, threads):
        raise RuntimeError(f"omnilab_rmsnorm rejected {rows} x {d} rows with {w_rows} weight rows")


_SLOT = KernelSlot(resolve)  # this process's choice, resolved on first use (KernelSlot: get, reset, use, loaded)
norm_choice, reset, use_norm = _SLOT.get, _SLOT.reset, _SLOT.use


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
    launch(lib, xc.data_ptr(), w.data_ptr(), y.data_ptr(), rows, d, w_rows, eps, code, torch.get_num_threads())
    return y
