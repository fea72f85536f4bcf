"""A decoder stack's one-token step in one kernel call (``stack.cpp``), and the MLP's SwiGLU activation.

Why: at one token per row a layer is ~8 kernel calls; made from Python (``models/decode_step.py``) each still
costs a ctypes call, a tensor allocation and glue, about 60-80 us per layer on 2 shared cores: at int4 the
0.6B frame's 103 layer steps (28 talker + 15 x 5 predictor) spend more there than a third of the kernels' own
time. :func:`stack_step` makes the same calls from C, through the function pointers of the libraries already
loaded (``gemv.cpp``, ``qgemv.cpp``, ``norm.cpp``, ``attn.cpp``), with the same arguments and order.

Numerics: bitwise the per-layer path (tests/models/test_decode_step.py): the residual adds are single fp32 adds,
the activation is :func:`swiglu`, which the per-layer and general MLP paths call as well. :func:`swiglu` computes
``silu(g) * u`` as torch's formula (``g / (1 + exp(-g))``, then the product) with glibc's vector ``expf`` (within
1 ulp of torch's); tests/kernels/test_stack.py bounds it against torch.

Choice, resolved once per process (:func:`stack_choice`), with a reason; ``OMNILAB_CPU_STACK`` overrides:
``auto`` (the kernel for the CPU's widest ISA if a C++ compiler builds it, else torch with a warning),
``omnilab`` / ``omnilab-avx512`` / ``omnilab-avx2`` (the kernel, or an error), ``torch`` (``F.silu(g) * u``,
and the layer steps from Python).
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from omnilab.kernels.choice import KERNEL_MODES, KernelChoice, KernelLib, KernelSlot, resolve_simple
from omnilab.kernels.trust import symbol

ENV = "OMNILAB_CPU_STACK"
MODES = KERNEL_MODES
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ACT_DTYPES = (torch.float32, torch.bfloat16)


class Kernels(ctypes.Structure):
    """stack.cpp's ``Kernels``: the entry points it calls."""
    _fields_ = [("gemv", _ptr), ("qgemv", _ptr), ("norm", _ptr), ("attn", _ptr), ("pattn", _ptr)]


class Mat(ctypes.Structure):
    """stack.cpp's ``Mat``: one bias-free decode matrix (kind 0: bf16 weights, 1: quantized)."""
    _fields_ = [("kind", _i64), ("w", _ptr), ("s", _ptr), ("n", _i64), ("k", _i64), ("bits", _i64), ("gs", _i64),
                ("act", _i64), ("s16", _i64)]


class Layer(ctypes.Structure):
    """stack.cpp's ``Layer``: one decoder layer's matrices, norm weights and attention geometry."""
    _fields_ = [("qkv", Mat), ("o", Mat), ("gu", Mat), ("down", Mat), ("ln1", _ptr), ("ln2", _ptr), ("qk", _ptr),
                ("ln1_eps", _f32), ("ln2_eps", _f32), ("qk_eps", _f32), ("scale", _f32), ("hq", _i64),
                ("hkv", _i64), ("d", _i64), ("inter", _i64)]


# f, L, nl, x, B, H, cos, sins, rope_stride, kptr, vptr, cap, pos, norm_w, norm_eps, out, dtype, nt
STEP_ARGTYPES = [_ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _f32, _ptr,
                 ctypes.c_int, ctypes.c_int]

# f, L, nl, x, B, H, cos, sins, rope_stride, caches, bt, bt_stride, pos, bs, Dp, nblocks, norm_w, norm_eps, out, nt
PAGED_ARGTYPES = [_ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _ptr,
                  _f32, _ptr, ctypes.c_int, ctypes.c_int]


def _Lib(path) -> KernelLib:  # noqa: N802  (the kernel tests build one per ISA: tests/_kernel_common.py)
    lib = KernelLib(path, "omnilab_swiglu", "omnilab_stack_isa", [_ptr, _ptr, _i64, _i64])
    lib.swiglu_bf16 = symbol(lib.lib, "omnilab_swiglu_bf16", path)
    lib.swiglu_bf16.argtypes = [_ptr, _ptr, _i64, _i64]
    lib.swiglu_bf16.restype = ctypes.c_int
    lib.step = symbol(lib.lib, "omnilab_stack_step", path)
    lib.step.argtypes = STEP_ARGTYPES
    lib.step.restype = ctypes.c_int
    lib.step_paged = symbol(lib.lib, "omnilab_stack_step_paged", path)
    lib.step_paged.argtypes = PAGED_ARGTYPES
    lib.step_paged.restype = ctypes.c_int
    return lib


def resolve(env: str | None = None, flags: frozenset[str] | None = None) -> tuple[KernelChoice, KernelLib | None]:
    """Decide (and build) without installing the result; :func:`stack_choice` caches it per process."""
    return resolve_simple(ENV, "decode stack", "stack", _Lib, "one call per decoder step, SwiGLU in one pass",
                          "layer steps from Python, F.silu(g) * u", env, flags)


_SLOT = KernelSlot(resolve)  # this process's choice, resolved on first use (KernelSlot: get, reset, use, loaded)
stack_choice, reset, use_stack, loaded_library = _SLOT.get, _SLOT.reset, _SLOT.use, _SLOT.loaded


def swiglu(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """``gu`` [..., 2 * inter] (gate then up, the fused projection's output) -> ``silu(gate) * up`` [..., inter].

    The kernel takes contiguous fp32 or bf16 CPU tensors outside autograd (under torch.compile, as an opaque call:
    a compiled MLP gives the same numbers as the eager one); anything else is torch's ``F.silu(gate) * up``. bf16:
    ``rnd(rnd(silu(g)) * u)``, silu in fp32 as for fp32 rows (torch's bf16 ops round the same two places)."""
    lib = _SLOT.loaded()
    if (lib is None or gu.dtype not in _ACT_DTYPES or gu.device.type != "cpu" or not gu.is_contiguous()
            or gu.shape[-1] != 2 * inter or (torch.is_grad_enabled() and gu.requires_grad)):
        return F.silu(gu[..., :inter]) * gu[..., inter:]
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_kernel)(lib, gu, inter)
    return _kernel(lib, gu, inter)


def _kernel(lib: KernelLib, gu: torch.Tensor, inter: int) -> torch.Tensor:
    y = torch.empty(*gu.shape[:-1], inter, dtype=gu.dtype)
    launch_swiglu(lib, gu.data_ptr(), y.data_ptr(), gu.numel() // (2 * inter) if inter else 0, inter,
                  gu.dtype == torch.bfloat16)
    return y


def swiglu_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for separate gate / up tensors (the MLP without fused projections): the same numbers
    as :func:`swiglu` over their concatenation."""
    if _SLOT.loaded() is None or gate.dtype not in _ACT_DTYPES or gate.shape != up.shape or gate.requires_grad:
        return F.silu(gate) * up
    return swiglu(torch.cat([gate, up], dim=-1), gate.shape[-1])


def launch_swiglu(lib: KernelLib, gu_p: int, y_p: int, rows: int, inter: int, bf16: bool = False) -> None:
    if (lib.swiglu_bf16 if bf16 else lib.fn)(gu_p, y_p, rows, inter):
        raise RuntimeError(f"omnilab_swiglu rejected {rows} rows of {inter}")
