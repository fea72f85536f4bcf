"""Fused SnakeBeta for code2wav: ``y = x + inv_beta * sin(alpha * x)^2`` in one pass over memory.

Why: code2wav is compute bound on CPU and runs this activation 29 times per 25-frame block, over activations
of up to 96 channels x 48,000 samples. torch needs four passes and two temporaries for it (mul, sin,
square, addcmul); ``snake.cpp`` reads ``x`` once and writes ``y`` once, with glibc's vector ``sinf`` (libmvec,
within 4 ulp of the exact sine; torch's is within 1 ulp). Measured on the released decoder geometry, 2
threads: 1.7-3x faster per call, 4-14 % off code2wav's time per frame in alternated runs.

Numerics: an element's result depends only on its value and its channel (tails use the same vector call),
so it does not depend on the chunk length, the chunk start, the batch or the thread count; against torch's
op it differs by a few ulp of the sine.

Choice, resolved once per process (:func:`snake_choice`), with a reason; ``OMNILAB_CPU_SNAKE`` overrides:
``auto`` (default: the kernel for the CPU's widest ISA if a C++ compiler builds it, else torch with a
warning), ``omnilab`` / ``omnilab-avx512`` / ``omnilab-avx2`` (the kernel, or an error), ``torch``.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from omnilab.kernels.choice import KERNEL_MODES, KernelSlot, resolve_kernel
from omnilab.kernels.trust import open_library, symbol

ENV = "OMNILAB_CPU_SNAKE"
MODES = KERNEL_MODES


@dataclass(frozen=True)
class SnakeChoice:
    """Which implementation :func:`snake_beta` uses, and why."""

    mode: str             # "omnilab" | "torch"
    isa: str | None       # "avx512" | "avx2" | None
    library: str | None   # path of the compiled kernel
    reason: str
    source: str           # "auto" | "env" | "argument" (use_snake)

    @property
    def label(self) -> str:
        return f"omnilab-{self.isa} fused" if self.mode == "omnilab" else "torch (4 passes)"

    def __repr__(self) -> str:
        return f"SnakeChoice({self.label!r}, source={self.source!r})"


class _Lib:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.lib = open_library(self.path)  # checked first (kernels/trust.py); a missing symbol: KernelBuildError
        fn = symbol(self.lib, "omnilab_snake", path)
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        self.fn = fn
        isa = symbol(self.lib, "omnilab_snake_isa", path)
        isa.restype = ctypes.c_char_p
        self.isa = isa().decode()


def resolve(env: str | None = None, flags: frozenset[str] | None = None) -> tuple[SnakeChoice, _Lib | None]:
    """Decide (and build) without installing the result; :func:`snake_choice` caches it per process."""
    lib, reason, source = resolve_kernel(ENV, "SnakeBeta", "snake", _Lib,
                                         "torch's elementwise ops (4 passes per call)", env, flags)
    if lib is None:
        return SnakeChoice("torch", None, None, reason, source), None
    reason = f"{reason}; one pass with glibc's vector sinf instead of torch's four"
    return SnakeChoice("omnilab", lib.isa, str(lib.path), reason, source), lib


_SLOT = KernelSlot(resolve)  # this process's choice, resolved on first use (KernelSlot: get, reset, use, loaded)
snake_choice, reset, use_snake = _SLOT.get, _SLOT.reset, _SLOT.use


def snake_torch(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """torch's version: ``x [B, C, L]``, ``alpha`` / ``inv_beta`` ``[C, 1]`` (exp'd alpha, 1 / (exp(beta) + eps)).
    Under autograd it keeps the intermediates (out-of-place ops)."""
    if torch.is_grad_enabled() and (x.requires_grad or alpha.requires_grad or inv_beta.requires_grad):
        s = torch.sin(x * alpha)
        return torch.addcmul(x, s * s, inv_beta)
    s = (x * alpha).sin_()
    s.mul_(s)
    return x.addcmul_(s, inv_beta) if inplace else torch.addcmul(x, s, inv_beta)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor, inplace: bool = False,
               lib: _Lib | None = None) -> torch.Tensor:
    """``x + inv_beta * sin(alpha * x)^2`` per channel: ``x [B, C, L]``, ``alpha`` / ``inv_beta`` ``[C, 1]``.

    The kernel takes contiguous fp32 CPU tensors outside autograd and torch.compile; anything else runs
    :func:`snake_torch`. ``inplace=True`` overwrites ``x`` (and returns it)."""
    lib = lib or _SLOT.loaded()
    if (lib is None or torch.compiler.is_compiling() or x.dim() != 3 or x.dtype != torch.float32
            or x.device.type != "cpu" or not x.is_contiguous() or alpha.dtype != torch.float32
            or inv_beta.dtype != torch.float32 or alpha.numel() != x.shape[1] or inv_beta.numel() != x.shape[1]
            or (torch.is_grad_enabled() and (x.requires_grad or alpha.requires_grad or inv_beta.requires_grad))):
        return snake_torch(x, alpha, inv_beta, inplace)
    a, ib = alpha.contiguous(), inv_beta.contiguous()
    y = x if inplace else torch.empty_like(x)
    bsz, c, n = x.shape
    if lib.fn(x.data_ptr(), a.data_ptr(), ib.data_ptr(), y.data_ptr(), bsz * c, c, n, torch.get_num_threads()):
        raise RuntimeError(f"omnilab_snake rejected shape {tuple(x.shape)}")  # unreachable: checked above
    return y
