"""Decode attention in one kernel call per layer: q/k norm, RoPE, the KV-cache write and attention for one new token.

Why: at one token per row, torch spends ~25 ops per layer on this (a cat, the q/k RMSNorm, a roll and three
elementwise ops for RoPE, transposes, two cache copies, SDPA); a 0.6B frame runs 103 such layer passes (28 talker
layers + 15 predictor passes x 5). ``attn.cpp`` does it in one call from the fused q/k/v projection output.

Numerics (``attn.cpp``): q/k norms as :mod:`omnilab.kernels.norm` (bitwise the same per head), RoPE with each op
rounded to the dtype as torch's, softmax and weighted sum in fp32 with each (row, head) whole on one thread; against
torch's SDPA the result differs by fp32 rounding (summation order), so greedy codes equal the torch path's on the
official goldens (tests/test_parity.py) but are not promised bit for bit; a row's result does not depend on its batch
mates, the thread count or the cache capacity (tests/kernels/test_attention.py). Both backends' code predictors and
the eager talker take it; vLLM's talker takes ``omnilab_paged_attn`` at decode (the same step over vLLM's paged fp32
cache, in the one-call stack; ``stages/vllm/model.py``), and vLLM's attention for prefills.

Choice, resolved once per process (:func:`attention_choice`), with a reason; ``OMNILAB_CPU_ATTN`` overrides:
``auto`` (default: the kernel for the CPU's widest ISA if it builds, else torch with a warning), ``omnilab`` /
``omnilab-avx512`` / ``omnilab-avx2`` (the kernel, or an error), ``torch`` (the ops above).
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from omnilab.kernels.choice import KERNEL_MODES, KernelChoice, KernelLib, KernelSlot, resolve_simple
from omnilab.kernels.trust import symbol

ENV = "OMNILAB_CPU_ATTN"
MODES = KERNEL_MODES
MAX_HEAD_DIM = 512
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P = ctypes.c_void_p


ARGTYPES = [_P, _P, _P, _P, ctypes.c_int64, _P, _P, _P, _P, _P] + [ctypes.c_int64] * 4 + \
    [ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int]


PAGED_ARGTYPES = [_P, _P, _P, _P, ctypes.c_int64, _P, _P, ctypes.c_int64, _P] + [ctypes.c_int64] * 3 + [_P] + \
    [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int]


def _Lib(path) -> KernelLib:  # noqa: N802  (the kernel tests build one per ISA: tests/_kernel_common.py)
    lib = KernelLib(path, "omnilab_decode_attn", "omnilab_attn_isa", ARGTYPES)
    lib.paged = symbol(lib.lib, "omnilab_paged_attn", path)  # over vLLM's paged "vec" cache (attn.cpp)
    lib.paged.argtypes = PAGED_ARGTYPES
    lib.paged.restype = ctypes.c_int
    return lib


def resolve(env: str | None = None, flags: frozenset[str] | None = None) -> tuple[KernelChoice, KernelLib | None]:
    """Decide (and build) without installing the result; :func:`attention_choice` caches it per process."""
    return resolve_simple(ENV, "decode attention", "attn", _Lib, "q/k norm, RoPE, cache write and attention of one "
                          "token in one call per layer", "~25 ops per layer", env, flags)


def paged_attention(lib: KernelLib, qkv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                    sin_signed: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, positions: Sequence[int],
                    num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """One token per row over vLLM's paged "vec" cache (``attn.cpp``'s layout note): ``qkv`` [B, (Hq + 2 Hkv) D]
    contiguous, ``cos`` / ``sin_signed`` [B, D], ``cache`` [blocks, Hkv, bs, 2 Dp] (one layer's), all fp32 or all
    bf16 (bf16: every op rounded as the contiguous kernel's bf16 mode), ``block_table`` [>= B, max_blocks] int32.
    Writes k/v at ``positions[b]`` and returns [B, Hq * D] of the dtype. The vLLM talker calls it through
    ``stack.cpp``; this form is for tests and study."""
    b = qkv.shape[0]
    nblocks, hkv, bs, two_dp = cache.shape
    dt = qkv.dtype
    if (dt not in (torch.float32, torch.bfloat16) or any(t.dtype != dt for t in (cache, norm_weight, cos, sin_signed))
            or block_table.dtype != torch.int32 or hkv != num_kv_heads or not cache.is_contiguous()
            or block_table.stride(1) != 1):
        raise ValueError("paged_attention takes qkv, norm weight, tables and cache [blocks, Hkv, bs, 2 Dp] of one "
                         "dtype (float32 or bfloat16) and int32 block table rows")
    out = torch.empty(b, num_heads * head_dim, dtype=dt)
    pos = (ctypes.c_int64 * b)(*positions)
    nw = norm_weight.contiguous()
    if lib.paged(qkv.data_ptr(), nw.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), head_dim, cache.data_ptr(),
                 block_table.data_ptr(), block_table.stride(0), pos, bs, two_dp // 2, nblocks, out.data_ptr(), b,
                 num_heads, num_kv_heads, head_dim, float(eps), float(scale), int(dt == torch.bfloat16),
                 torch.get_num_threads()):
        raise RuntimeError(f"omnilab_paged_attn rejected B={b}, heads {num_heads}/{num_kv_heads}, D={head_dim}, "
                           f"cache {tuple(cache.shape)}, positions {list(positions)}")
    return out


def launch(lib: KernelLib, qkv_p: int, nw_p: int, cos_p: int, sin_p: int, rope_stride: int, kp: list[int],
           vp: list[int], caps: list[int], positions: list[int], out_p: int, heads: tuple[int, int, int], eps: float,
           scale: float, code: int, threads: int) -> None:
    """The kernel on raw pointers (:func:`decode_attention` and the decode step call it): per row its k/v cache
    pointers, capacity and position; ``heads`` = (Hq, Hkv, D); ``code`` 0 fp32, 1 bf16."""
    b = len(positions)
    arr = ctypes.c_int64 * b
    hq, hkv, d = heads
    if lib.fn(qkv_p, nw_p, cos_p, sin_p, rope_stride, arr(*kp), arr(*vp), arr(*caps), arr(*positions), out_p, b, hq,
              hkv, d, float(eps), float(scale), code, threads):
        raise RuntimeError(f"omnilab_decode_attn rejected B={b}, heads {hq}/{hkv}, D={d}, positions "
                           f"{list(positions)} for capacities {list(caps)}")


_SLOT = KernelSlot(resolve)  # this process's choice, resolved on first use (KernelSlot: get, reset, use, loaded)
attention_choice, reset, use_attention = _SLOT.get, _SLOT.reset, _SLOT.use


def decode_attention(qkv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin_signed: torch.Tensor, k_bufs: Sequence[torch.Tensor], v_bufs: Sequence[torch.Tensor],
                     positions: Sequence[int], num_heads: int, num_kv_heads: int, head_dim: int,
                     scale: float) -> torch.Tensor | None:
    """One token per row: ``qkv`` [B, 1, (Hq + 2 Hkv) * D] contiguous (the fused projection), ``norm_weight``
    [Hq + Hkv, D] (q_norm's then k_norm's, per head), ``cos`` / ``sin_signed`` [1 or B, 1, D] (the decoder's RoPE
    rows), per row its cache buffers ``k_bufs[b]`` / ``v_bufs[b]`` [Hkv, capacity, D] (views of the decoder's
    KVCache) and ``positions[b]`` (where the token goes). Writes k and v at that position and returns the attention
    output [B, 1, Hq * D], or None where the kernel does not apply (the caller runs torch's ops)."""
    lib = _SLOT.loaded()
    code = _DTYPES.get(qkv.dtype)
    b = qkv.shape[0]
    if (lib is None or code is None or head_dim > MAX_HEAD_DIM or head_dim % 2 or num_heads % num_kv_heads
            or torch.compiler.is_compiling() or not qkv.is_contiguous() or norm_weight.dtype != qkv.dtype
            or cos.dtype != qkv.dtype or sin_signed.dtype != qkv.dtype or not cos.is_contiguous()
            or not sin_signed.is_contiguous() or (torch.is_grad_enabled() and qkv.requires_grad)):
        return None
    caps, kp, vp = [], [], []
    for kb, vb in zip(k_bufs, v_bufs):
        if kb.dtype != qkv.dtype or not kb.is_contiguous() or not vb.is_contiguous():
            return None
        caps.append(kb.shape[1])
        kp.append(kb.data_ptr())
        vp.append(vb.data_ptr())
    nw = norm_weight if norm_weight.is_contiguous() else norm_weight.contiguous()
    out = torch.empty(b, 1, num_heads * head_dim, dtype=qkv.dtype)
    launch(lib, qkv.data_ptr(), nw.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
           0 if cos.shape[0] == 1 else head_dim, kp, vp, caps, list(positions), out.data_ptr(),
           (num_heads, num_kv_heads, head_dim), eps, scale, code, torch.get_num_threads())
    return out
