"""Weight-only quantized decode linears: ``qlinear(x, qw, bias)`` over a :class:`~omnilab.kernels.quant.
QuantizedWeight` (int8 per channel or int4 per group), for 1..16 fp32 rows with omnilab's kernel.

Why: a decode step is bandwidth bound and reads every matrix once; int8 codes are half the bytes of bf16,
int4 a quarter (plus fp16 scales). ``qgemv.cpp`` streams the codes once for all rows (layout: quant.py).

Activations (``activations=``, default :data:`DEFAULT_ACTIVATIONS`):

- ``"int8"``: x is quantized per row and 32-wide block of K (``quant.quantize_activations``; blocks rather than
  whole rows so that an outlier channel only coarsens its own block) and each block's dot is exact int32
  (AVX-512 VNNI ``vpdpbusd``; AVX2 ``vpmaddubsw``). Error against ``x @ dequantize().T``:
  per block at most ``xs/2 * sum|w|`` (xs = block amax / 127), besides fp32 rounding;
  ``quant.int8_act_reference`` is the same computation in torch (equal up to fp32 rounding of the block sum).
- ``"int16"``: the same with 16-bit activation codes (``quantize_activations(x, bits=16)``; AVX-512 VNNI
  ``vpdpwssd``, AVX2 ``vpmaddwd``): 1/256 of int8's activation error, so the result is ``x @ dequantize().T``
  within ~2e-5 relative per block, at the integer path's speed (no code expanded to fp32).
  ``quant.int_act_reference(x, qw, 16)`` is the same computation in torch.
- ``"fp32"``: codes expanded to fp32 in registers, FMA with x: only the weights are quantized; the result is
  ``x @ dequantize().T`` up to fp32 rounding (K products summed in another order).

Rows beyond 16 (prefill) run the kernel in one call up to ``CHUNKED_MAX_ROWS`` (the codes streamed once for all
rows; measured faster than dequantizing), beyond that dequantize 1024 output rows at a time and use torch's GEMM
with fp32 activations.
Autograd inputs take the dequantized ``F.linear``. A row's result does not depend on its batch mates, the
thread count or the ISA (bitwise; see qgemv.cpp).

Choice, resolved once per process (:func:`qgemv_choice`), with a reason; ``OMNILAB_CPU_QGEMV`` overrides:
``auto`` (default: the kernel for the CPU's widest ISA if a C++ compiler builds it, else torch with a warning),
``omnilab`` / ``omnilab-avx512`` / ``omnilab-avx2`` (the kernel, or an error), ``torch``. The avx512 build
needs ``avx512_vnni`` too; a CPU with avx512f and no VNNI gets the avx2 build under ``auto``. The torch
fallback computes the same result up to fp32 rounding (``fp32``: dequantize + ``F.linear``; ``int8`` / ``int16``:
``quant.int_act_reference``).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from omnilab import settings
from omnilab.hardware import avx512_without_vnni, cpu_flags
from omnilab.kernels.choice import KERNEL_MODES, KernelSlot, resolve_kernel
from omnilab.kernels.quant import ROWS, QuantizedWeight, int_act_reference
from omnilab.kernels.trust import open_library, symbol

ENV = "OMNILAB_CPU_QGEMV"
MODES = KERNEL_MODES
MAX_ROWS = 16            # rows per call that take the kernel (weights streamed once for all of them)
PREFILL_BLOCK = 1024     # output rows dequantized at a time beyond CHUNKED_MAX_ROWS
# Up to this many rows (a prefill) the kernel runs in one call instead of dequantizing the matrix per call (in
# 16-row blocks before: measured on Zen 4, 2 threads, [3072, 1024], median of 5: int4 g128 32/100/300/1000 rows
# 0.8/2.4/6.9/13.1 ms vs 14.0/16.9/28.2/41.2 dequantized; int8 1.1/3.4/9.6/32.0 vs 5.5/8.8/16.0/40.1). One call reads
# the codes from memory once for all rows (docs/kernels.md#quantized-gemv-int8--int4-weights). A row's result stays
# independent of the other rows, as at decode.
CHUNKED_MAX_ROWS = 1024
ACTIVATIONS = ("int8", "int16", "fp32")
ACT_MODE = {"fp32": 0, "int8": 1, "int16": 2}  # qgemv.cpp's act argument
# int8 activations: as fast as fp32 where the call is bandwidth bound (1 row, 2 threads) and 1.3-2.2x faster
# where the conversions make the fp32 mode compute bound (4 rows; 1 thread); measured over the 0.6B talker's
# layer matrices on 2 Zen 4 cores. Cost: ~0.5 % relative error on Gaussian inputs, ~1.2 % with 50x outlier
# channels (int4 weights alone: ~10 %; int8 weights alone: ~0.8 %, so int8 weights may prefer "fp32").
DEFAULT_ACTIVATIONS = "int8"


@dataclass(frozen=True)
class QgemvChoice:
    """Which implementation :func:`qlinear` uses for 1..``max_rows`` rows, and why."""

    mode: str                 # "omnilab" | "torch"
    isa: str | None           # "avx512" | "avx2" | None
    library: str | None       # path of the compiled kernels
    reason: str
    source: str               # "auto" | "env" | "argument" (use_qgemv)
    max_rows: int = MAX_ROWS
    prefetch: tuple[int, int, int] | None = None  # bytes per kind of call (tuning/prefetch.py), None: torch

    @property
    def label(self) -> str:
        return f"omnilab-{self.isa} for 1-{self.max_rows} rows" if self.mode == "omnilab" else "torch"

    def __repr__(self) -> str:
        return f"QgemvChoice({self.label!r}, source={self.source!r})"


class _Lib:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.lib = open_library(self.path)  # checked first (kernels/trust.py); a missing symbol: KernelBuildError
        fn = symbol(self.lib, "omnilab_qgemv", path)
        # x, w, s, s16, b, y, M, N, K, bits, gs, act, nt
        fn.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3
                       + [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int])
        fn.restype = ctypes.c_int
        self.fn = fn
        pf = symbol(self.lib, "omnilab_qgemv_set_prefetch", path)
        pf.argtypes = [ctypes.c_int64] * 3
        pf.restype = ctypes.c_int
        self.set_prefetch = pf
        isa = symbol(self.lib, "omnilab_qgemv_isa", path)
        isa.restype = ctypes.c_char_p
        self.isa = isa().decode()


def _no_vnni(flags: frozenset[str]) -> bool:
    return avx512_without_vnni(flags)


def resolve(env: str | None = None, flags: frozenset[str] | None = None) -> tuple[QgemvChoice, _Lib | None]:
    """Decide (and build) without installing the result; :func:`qgemv_choice` caches it per process."""
    if flags is None:
        flags = cpu_flags()
    flags = frozenset(flags)
    note = ""
    if _no_vnni(flags):  # the avx512 build uses vpdpbusd: such a CPU runs the avx2 build
        raw = ((settings.raw(ENV) or "") if env is None else env).strip().lower()
        if raw == "omnilab-avx512":
            raise RuntimeError(f"{ENV}=omnilab-avx512 needs a CPU with avx512f and avx512_vnni and avx512bw (vpdpbusd, "
                               "vpdpwssd); this one has avx512f without avx512_vnni or avx512bw: use omnilab-avx2 or auto")
        flags, note = flags - {"avx512f"}, " (avx512f without avx512_vnni or avx512bw: the avx2 build)"
    lib, reason, source = resolve_kernel(ENV, "quantized GEMV", "qgemv", _Lib, "torch: dequantize + F.linear "
                                         "(fp32 activations) or its int8-activation reference", env, flags)
    if lib is None:
        return QgemvChoice("torch", None, None, reason + note, source), None
    from omnilab.tuning.prefetch import SLOTS, resolve as resolve_prefetch  # cycle: omnilab.tuning

    pf = resolve_prefetch(lib)
    dots = "vpdpbusd / vpdpwssd" if lib.isa == "avx512" else "vpmaddubsw / vpmaddwd"
    reason = (f"{reason}{note}; 1-{MAX_ROWS} rows stream the int8/int4 codes once ({dots} for int8 / int16 "
              f"activations), prefill: the kernel in one call up to {CHUNKED_MAX_ROWS} rows, torch GEMM over "
              f"dequantized blocks beyond; software prefetch {'/'.join(map(str, pf.distances))} bytes ({', '.join(SLOTS)}): {pf.reason}")
    return QgemvChoice("omnilab", lib.isa, str(lib.path), reason, source, prefetch=pf.distances), lib


_SLOT = KernelSlot(resolve)  # this process's choice, resolved on first use (KernelSlot: get, reset, use, loaded)
qgemv_choice, reset, use_qgemv, loaded_library = _SLOT.get, _SLOT.reset, _SLOT.use, _SLOT.loaded


def _check_activations(activations: str | None) -> str:
    activations = DEFAULT_ACTIVATIONS if activations is None else activations
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r}; accepted: {', '.join(ACTIVATIONS)}")
    return activations


def qgemv_rows(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, lib: _Lib | None = None,
               activations: str | None = None) -> torch.Tensor:
    """The kernel itself: ``x`` [..., K] fp32 (1..16 rows) over ``qw`` [N, K] (+ ``bias`` [N] fp32) -> [..., N].

    No dispatch: raises if the kernel is not available or the inputs do not fit it."""
    activations = _check_activations(activations)
    lib = lib or _SLOT.loaded()
    if lib is None:
        raise RuntimeError(f"omnilab quantized GEMV kernel not in use: {qgemv_choice().reason}")
    n, k = qw.shape
    if x.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        raise TypeError(f"qgemv_rows takes float32 x and bias, got {x.dtype} x")
    if x.shape[-1] != k or (bias is not None and tuple(bias.shape) != (n,)):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, weight {qw.shape}, "
                         f"bias {None if bias is None else tuple(bias.shape)}")
    rows = x.numel() // k if k else 0
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"qgemv_rows takes 1..{MAX_ROWS} rows, got {rows}")
    return _call(lib, x, qw, bias, rows, activations)


def _call(lib: _Lib, x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, rows: int,
          activations: str) -> torch.Tensor:
    n, k = qw.shape
    x2 = x.reshape(rows, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    b = None if bias is None else bias.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    launch(lib, x2.data_ptr(), qw, None if b is None else b.data_ptr(), y.data_ptr(), rows, activations,
           torch.get_num_threads())
    return y


def launch(lib: _Lib, xp: int, qw: QuantizedWeight, bp: int | None, yp: int, rows: int, activations: str,
           threads: int) -> None:
    """The kernel on raw pointers (``_call`` and the decode step call it): fp32 rows at ``xp`` over ``qw``
    (+ fp32 bias at ``bp``) into ``yp`` [rows, N], with ``activations`` (:data:`ACTIVATIONS`)."""
    n, k = qw.shape
    if lib.fn(xp, qw.qweight.data_ptr(), qw.scales.data_ptr(), int(qw.scales.dtype == torch.float16), bp, yp, rows,
              n, k, qw.bits, qw.group_size, ACT_MODE[activations], threads):
        raise ValueError(f"omnilab_qgemv rejected {qw!r} with {rows} rows")


def dequantized_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over the dequantized matrix, ``PREFILL_BLOCK`` output rows at a time (fp32 activations)."""
    n = qw.shape[0]
    if n <= PREFILL_BLOCK:
        return F.linear(x, qw.dequantize(), bias)
    step = PREFILL_BLOCK // ROWS
    parts = [F.linear(x, qw.dequantize(slice(b, b + step)), None) for b in range(0, qw.padded_n // ROWS, step)]
    y = torch.cat(parts, dim=-1)[..., :n]
    return y + bias if bias is not None else y


def qlinear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
            activations: str | None = None) -> torch.Tensor:
    """``x`` [..., K] @ ``qw``^T (+ ``bias``) -> fp32 [..., N]: the kernel for 1..16 fp32 CPU rows outside
    autograd, torch otherwise (see the module docstring). Non-fp32 ``x`` is computed in fp32 and cast back."""
    activations = _check_activations(activations)
    if x.dtype != torch.float32:
        return qlinear(x.float(), qw, None if bias is None else bias.float(), activations).to(x.dtype)
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    k = x.shape[-1]
    if k != qw.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not fit the quantized weight {qw.shape}")
    rows = x.numel() // k if k else 0
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return F.linear(x, qw.dequantize(), bias)
    lib = _SLOT.loaded()
    if rows == 0 or rows > CHUNKED_MAX_ROWS or (rows > MAX_ROWS and (lib is None or x.device.type != "cpu")):
        return dequantized_linear(x, qw, bias)
    if lib is not None and x.device.type == "cpu":
        return _call(lib, x, qw, bias, rows, activations)  # decode rows, or a prefill in one call
    if activations == "fp32":
        return F.linear(x, qw.dequantize(), bias)
    y = int_act_reference(x, qw, 16 if activations == "int16" else 8)
    return y + bias if bias is not None else y
