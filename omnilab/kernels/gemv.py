"""Small-batch fp32 linear layers: omnilab's GEMV kernel for 4..8 rows, torch (MKL) otherwise.

Why: decode reads every weight once per step, so a linear over B decoding rows should cost about what one
row costs. MKL's fp32 GEMM does so for 1-3 rows but reads the weights at about half its 1-row bandwidth from 4
rows on (docs/kernels.md#gemv-kernel); the kernel in ``gemv.cpp`` streams the weights once for all rows. Below 4 rows torch is as fast
and keeps the numerics of the reference implementation (single-stream codes stay identical to
qwen-tts); above 8 rows (prefill) the GEMM is compute bound and MKL's.

Choice, resolved once per process (:func:`gemv_choice`), with a reason; ``OMNILAB_CPU_GEMV`` overrides:

- ``auto`` (default): the kernel for the CPU's widest ISA (avx512 or avx2 + fma) if a C++ compiler builds
  it; otherwise torch everywhere, with a warning that says why;
- ``omnilab`` / ``omnilab-avx512`` / ``omnilab-avx2``: the kernel (that ISA), or an error if it cannot be
  built or the CPU lacks the ISA;
- ``torch``: ``F.linear`` everywhere.

:func:`linear` is the drop-in for ``F.linear`` used by the decoder stacks; it takes the kernel only for
fp32 CPU inputs with 4..8 rows outside autograd and outside torch.compile tracing, and for fp32 inputs over
bf16-stored weights (:mod:`omnilab.tuning.storage`) with 1..16 rows: there the kernel expands the bf16
exactly in registers and reads half the bytes (1 row over the predictor's matrices: 5.9 vs 10.1 ms per
pass for MKL on fp32 copies). A row's result is bitwise the fp32 kernel's on the exact fp32 copy.

Two paths follow the timing of this machine (:mod:`omnilab.tuning.timing`, installed by ``install_paths`` when a
talker loads; the ISA rule before): bf16 compute's 1-16-row linears over bf16 weights take the kernel on the rows
widened exactly to fp32 and round the result once (``bf16_decode="kernel"``), and fp32 prefills over bf16-stored
matrices take a bf16 GEMM (``prefill="bf16"``) instead of widening the matrix
(docs/kernels.md#measured-dtype-and-linear-paths).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from omnilab.kernels.choice import KERNEL_MODES, KernelSlot, resolve_kernel
from omnilab.kernels.qgemv import qlinear
from omnilab.kernels.quant import AUTO_ACTIVATIONS, QuantizedWeight
from omnilab.kernels.trust import open_library, symbol

ENV = "OMNILAB_CPU_GEMV"
MODES = KERNEL_MODES
MIN_ROWS, MAX_ROWS = 4, 8  # rows (tokens) per call that take the kernel; see the module docstring
# bf16-stored weights with fp32 inputs: the kernel for 1..16 rows (two 8-row passes over the half-size
# weights beat converting them); more rows (prefill) convert the matrix and use torch's GEMM, which is
# compute bound there (measured over the 0.6B talker's matrices: 16 rows 161 vs 242 ms, 64 rows 625 vs 437).
BF16_MAX_ROWS = 16


@dataclass(frozen=True)
class GemvChoice:
    """Which implementation :func:`linear` uses for ``min_rows..max_rows`` rows, and why."""

    mode: str                 # "omnilab" | "torch"
    isa: str | None           # "avx512" | "avx2" | None
    library: str | None       # path of the compiled kernels
    reason: str
    source: str               # "auto" | "env" | "argument" (use_gemv)
    min_rows: int = MIN_ROWS
    max_rows: int = MAX_ROWS

    @property
    def label(self) -> str:
        return f"omnilab-{self.isa} for {self.min_rows}-{self.max_rows} rows" if self.mode == "omnilab" else "torch"

    def __repr__(self) -> str:
        return f"GemvChoice({self.label!r}, source={self.source!r})"


class _Lib:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.lib = open_library(self.path)  # checked first (kernels/trust.py); a missing symbol: KernelBuildError
        fn = symbol(self.lib, "omnilab_gemv_f32", path)
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        self.fn = fn
        self.fn_bf16w = symbol(self.lib, "omnilab_gemv_bf16w", path)
        self.fn_bf16w.argtypes = fn.argtypes
        self.fn_bf16w.restype = ctypes.c_int
        isa = symbol(self.lib, "omnilab_gemv_isa", path)
        isa.restype = ctypes.c_char_p
        self.isa = isa().decode()
        self.max_rows = int(symbol(self.lib, "omnilab_gemv_max_rows", path)())


def resolve(env: str | None = None, flags: frozenset[str] | None = None) -> tuple[GemvChoice, _Lib | None]:
    """Decide (and build) without installing the result; :func:`gemv_choice` caches it per process."""
    lib, reason, source = resolve_kernel(ENV, "GEMV", "gemv", _Lib, "torch (MKL) for every row count: 4-8 rows "
                                         "read the weights at about half the 1-row bandwidth", env, flags)
    if lib is None:
        return GemvChoice("torch", None, None, reason, source), None
    reason = (f"{reason}; {MIN_ROWS}-{MAX_ROWS} rows stream the weights once (MKL reads them at ~half "
              f"bandwidth there), 1-{MIN_ROWS - 1} rows and prefill stay on torch (MKL)")
    return GemvChoice("omnilab", lib.isa, str(lib.path), reason, source, MIN_ROWS,
                      min(MAX_ROWS, lib.max_rows)), lib


_SLOT = KernelSlot(resolve)  # this process's choice, resolved on first use (KernelSlot: get, reset, use, loaded)
gemv_choice, reset, use_gemv, loaded_library = _SLOT.get, _SLOT.reset, _SLOT.use, _SLOT.loaded


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              lib: _Lib | None = None) -> torch.Tensor:
    """The kernel itself: ``x`` [..., K] fp32 (1..8 rows) @ ``weight`` [N, K]^T (+ ``bias`` [N]) -> [..., N].

    No dispatch: raises if the kernel is not available or the inputs do not fit it."""
    lib = lib or _SLOT.loaded()
    if lib is None:
        raise RuntimeError(f"omnilab GEMV kernel not in use: {gemv_choice().reason}")
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    limit = BF16_MAX_ROWS if weight.dtype == torch.bfloat16 else lib.max_rows
    if not 1 <= rows <= limit:
        raise ValueError(f"gemv_rows takes 1..{limit} rows with {weight.dtype} weights, got {rows}")
    if (x.dtype != torch.float32 or weight.dtype not in (torch.float32, torch.bfloat16)
            or (bias is not None and bias.dtype != torch.float32)):
        raise TypeError(f"gemv_rows takes float32 x and bias and float32 or bfloat16 weights, "
                        f"got {x.dtype} x {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != k or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}")
    return _call(lib, x, weight, bias, rows)


def _call(lib: _Lib, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    n, k = weight.shape
    x2 = x.reshape(rows, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    b = None if bias is None else bias.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    launch(lib, x2.data_ptr(), w, None if b is None else b.data_ptr(), y.data_ptr(), rows, torch.get_num_threads())
    return y


def launch(lib: _Lib, xp: int, w: torch.Tensor, bp: int | None, yp: int, rows: int, threads: int) -> None:
    """The kernel on raw pointers (``_call`` and the decode step call it): fp32 rows at ``xp`` over the contiguous
    fp32 or bf16 ``w`` [N, K] (+ fp32 bias at ``bp``) into ``yp`` [rows, N]."""
    n, k = w.shape
    (lib.fn_bf16w if w.dtype == torch.bfloat16 else lib.fn)(xp, w.data_ptr(), bp, yp, rows, n, k, threads)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with the kernel for fp32 CPU inputs of 4..8 rows (see the module docstring), and for
    fp32 inputs over bf16-stored weights (:mod:`omnilab.tuning.storage`) of 1..16 rows. A
    :class:`~omnilab.kernels.quant.QuantizedWeight` (quantized at load) goes to :func:`~omnilab.kernels.qgemv.
    qlinear` with its ``activations`` (None: :data:`~omnilab.kernels.quant.AUTO_ACTIVATIONS` of its method)."""
    if isinstance(weight, QuantizedWeight):  # ctypes kernel: under torch.compile (OMNILAB_CPU_INDUCTOR) a graph break
        return torch.compiler.disable(_quantized)(x, weight, bias) if torch.compiler.is_compiling() else \
            _quantized(x, weight, bias)
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
        return _linear_bf16_weight(x, weight, bias)
    if torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    lib = _SLOT.loaded()
    if x.dtype == weight.dtype == torch.bfloat16 and lib is not None:  # bf16 compute: decode rows via the kernel
        rows = _kernel_rows(lib, x, weight, bias, 1, BF16_MAX_ROWS)
        if rows and _paths().bf16_decode == "kernel":
            return _call(lib, x.float(), weight, None if bias is None else bias.float(), rows).to(torch.bfloat16)
    rows = fp32_kernel_rows(x, weight, bias, MIN_ROWS)
    return _call(lib, x, weight, bias, rows) if rows else F.linear(x, weight, bias)  # else torch (or its error)


def fp32_kernel_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, lo: int = 1,
                     hi: int = MAX_ROWS) -> int:
    """The row count of ``x`` if this process's fp32 kernel can take ``x @ weight^T (+ bias)`` (``lo..hi`` rows, all
    three fp32, the conditions of ``_kernel_rows``), else 0: :func:`linear` for 4..8 rows, code2wav's short convs
    and small linears for 1..8 (``omnilab.models.conv_paths``)."""
    if not (x.dtype == weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)):
        return 0
    lib = _SLOT.loaded()
    return _kernel_rows(lib, x, weight, bias, lo, min(hi, lib.max_rows)) if lib is not None else 0


def _quantized(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = qlinear(x, weight, bias, weight.activations or AUTO_ACTIVATIONS[weight.method])
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _kernel_rows(lib: _Lib | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 lo: int, hi: int) -> int:
    """The row count of ``x`` if the kernel can take this call (``lo..hi`` rows, shapes that fit, contiguous
    weight, CPU tensors, no autograd), else 0. Dtypes are the caller's check."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (lib is None or not lo <= rows <= hi or weight.dim() != 2 or weight.shape[1] != k
            or not weight.is_contiguous() or (bias is not None and bias.shape != (weight.shape[0],))
            or x.device.type != "cpu" or weight.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return 0
    return rows


def _linear_bf16_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``x`` over a bf16-stored ``weight``: the kernel expands the weights exactly in registers; where
    it does not apply, the matrix is converted (exact) for this call and torch computes in fp32. Under
    torch.compile (vLLM's talker compile path, ``OMNILAB_CPU_INDUCTOR``) it is one opaque custom op, so the
    compiled graph calls the same code instead of converting the matrix in every step."""
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    if torch.compiler.is_compiling():
        return torch.ops.omnilab.linear_bf16_weight(x, weight, bias)
    return _bf16_weight_eager(x, weight, bias)


def _bf16_weight_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lib = _SLOT.loaded()
    rows = _kernel_rows(lib, x, weight, bias, 1, BF16_MAX_ROWS)
    if rows:
        return _call(lib, x, weight, bias, rows)
    if x.numel() // max(x.shape[-1], 1) > BF16_MAX_ROWS and _paths().prefill == "bf16":  # measured faster here
        y = F.linear(x.to(torch.bfloat16), weight).float()
        return y if bias is None else y + bias
    return F.linear(x, weight.float(), bias)


@dataclass(frozen=True)
class _PriorPaths:
    """The ISA rule's paths (omnilab.profiles.timing without a timing) until :func:`install_paths` sets measured ones."""
    bf16_decode: str = "kernel"
    prefill: str = "fp32"


_INSTALLED: list = []


def install_paths(paths) -> None:
    """Make ``paths`` (an ``omnilab.tuning.timing.LinearPaths``; None: the prior) what :func:`linear` follows for
    bf16 decode rows and fp32 prefills. ``omnilab.tuning.timing.linear_paths`` does it when it resolves (at load)."""
    _INSTALLED[:] = [] if paths is None else [paths]


def _paths():
    return _INSTALLED[0] if _INSTALLED else _PriorPaths()


@torch.library.custom_op("omnilab::linear_bf16_weight", mutates_args=())
def _bf16_weight_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _bf16_weight_eager(x, weight, bias)


@_bf16_weight_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
