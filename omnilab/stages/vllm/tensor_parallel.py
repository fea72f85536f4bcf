"""Tensor-parallel talker ranks: each vLLM worker rank holds a slice of the talker's attention and MLP matrices.

Contract (docs/vllm-seam.md#tensor-parallel-talker):
- ``check_shardable(tc, tp, quantization)`` raises :class:`~omnilab.errors.InputError` naming the geometry that
  does not split ``tp`` ways (query heads, key/value heads, MLP width; for int4 the row-parallel inputs must hold
  whole quantization groups). Plain Python.
- ``shard_talker(talker, rank, tp)`` cuts the talker decoder's matrices in place the way vLLM's parallel linear
  layers split a Qwen3 decoder: q/k/v and gate/up *column parallel* (rank r keeps output rows of its heads / its
  MLP slice), o_proj and down_proj *row parallel* (rank r keeps the input columns of those heads / that slice).
  Each rank's partial o_proj / down_proj outputs add up to the unsplit product; :func:`all_reduce` (vLLM's
  tensor-parallel group, its CPU communicator) does the sum, after every attention and every MLP. The codec
  head, the embeddings, the norms and the whole code predictor stay replicated: every rank samples c0 and runs
  the 15-step predictor on the same hidden state (after the all-reduce every rank holds the same bits), so every
  rank keeps the frame history its next input vector needs, with no broadcast per frame (docs say why).
- Quantized weights (:class:`~omnilab.kernels.quant.QuantizedWeight`) are cut on their codes and scales, so a
  rank's shard holds exactly the values of the unsplit matrix (int4 column cuts fall on group boundaries).
- ``rank_info()`` -> ``(rank, size)`` of vLLM's tensor-parallel group in this process ((0, 1) outside one).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from omnilab.errors import InputError


def check_shardable(tc: Any, tp: int, quantization: Any = None) -> None:
    """Raise InputError unless the talker config ``tc`` (``Qwen3TTSConfig.talker``) splits ``tp`` ways."""
    if tp == 1:
        return
    hq, hkv, inter, d = tc.num_attention_heads, tc.num_key_value_heads, tc.intermediate_size, tc.head_dim
    bad = [f"{what} {n}" for what, n in (("query heads", hq), ("key/value heads", hkv), ("MLP width", inter))
           if n % tp]
    if bad:
        ok = [str(n) for n in range(1, hkv + 1) if not hq % n and not hkv % n and not inter % n]
        raise InputError(f"a {tp}-rank tensor-parallel talker needs query heads, key/value heads and the MLP width "
                         f"divisible by {tp}; this checkpoint has {', '.join(bad)} (accepted sizes: {', '.join(ok)})")
    group = getattr(quantization, "group_size", None)  # None without int4 parts
    if group:
        cols = {"o_proj input": hq * d // tp, "down_proj input": inter // tp}
        uneven = [f"{k} {v}" for k, v in cols.items() if v % group]
        if uneven:
            raise InputError(f"int4 group size {group} does not divide each rank's row-parallel inputs "
                             f"({', '.join(uneven)} columns at tensor_parallel_size={tp}); use a smaller "
                             f"quant_group_size or tensor_parallel_size")


def _cut(weight: Any, dim: int, lo: int, hi: int) -> Any:
    """Rows (``dim=0``) or columns (``dim=1``) ``lo:hi`` of a weight tensor or a ``QuantizedWeight``, as a new
    contiguous tensor holding the same values."""
    import torch

    from omnilab.kernels.quant import QuantizedWeight, from_codes  # lazy: torch
    if isinstance(weight, QuantizedWeight):
        codes, scales = weight.codes(), weight.row_scales()  # [N, K] int8, [N, groups] fp32
        group = weight.group_size if weight.method == "int4" else None  # int8: one scale per row spans any cut
        if dim == 0:
            codes, scales = codes[lo:hi], scales[lo:hi]
        else:
            codes, scales = codes[:, lo:hi], (scales[:, lo // group:hi // group] if group else scales)
        out = from_codes(weight.method, codes.contiguous(), scales.contiguous(), group)
        return dataclasses.replace(out, activations=weight.activations)
    part = weight.detach()[lo:hi] if dim == 0 else weight.detach()[:, lo:hi]
    return torch.nn.Parameter(part.contiguous().clone(), requires_grad=False)


def _set(linear: Any, dim: int, lo: int, hi: int) -> None:
    held = "weight" in linear._parameters  # a Parameter; else a QuantizedWeight attribute (Quantization.install)
    w = linear._parameters["weight"] if held else linear.__dict__["weight"]
    new = _cut(w, dim, lo, hi)
    if held:
        linear._parameters["weight"] = new
    else:
        linear.__dict__["weight"] = new
    if dim == 0 and getattr(linear, "bias", None) is not None:
        linear.bias = type(linear.bias)(linear.bias.detach()[lo:hi].contiguous().clone(), requires_grad=False)
    if dim == 0:
        linear.out_features = hi - lo
    else:
        linear.in_features = hi - lo


def shard_talker(talker: Any, rank: int, tp: int) -> None:
    """Keep rank ``rank`` of ``tp``'s slice of every talker decoder layer (see the module docstring). A row-parallel
    bias (none in Qwen3-TTS) would be added once, on rank 0."""
    if tp == 1:
        return
    tc = talker.cfg.talker
    check_shardable(tc, tp, getattr(talker, "quantization", None))
    d = tc.head_dim
    hq, hkv, inter = tc.num_attention_heads // tp, tc.num_key_value_heads // tp, tc.intermediate_size // tp
    for layer in talker.model.layers:
        a, m = layer.self_attn, layer.mlp
        _set(a.q_proj, 0, rank * hq * d, (rank + 1) * hq * d)
        for proj in (a.k_proj, a.v_proj):
            _set(proj, 0, rank * hkv * d, (rank + 1) * hkv * d)
        _set(a.o_proj, 1, rank * hq * d, (rank + 1) * hq * d)
        for proj in (m.gate_proj, m.up_proj):
            _set(proj, 0, rank * inter, (rank + 1) * inter)
        _set(m.down_proj, 1, rank * inter, (rank + 1) * inter)
        for proj in (a.o_proj, m.down_proj):
            if rank and getattr(proj, "bias", None) is not None:
                proj.bias.data.zero_()
        a.num_heads, a.num_kv_heads = hq, hkv
        a._qk_key = None  # the stacked q/k norm weights follow the new head counts
    talker.tensor_parallel = (rank, tp)


def rank_info() -> tuple[int, int]:
    """``(rank, size)`` of vLLM's tensor-parallel group in this process; ``(0, 1)`` where none is initialised."""
    from vllm.distributed import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def all_reduce(x: Any) -> Any:
    """Sum ``x`` over the tensor-parallel ranks (vLLM's group and CPU communicator); every rank gets the sum."""
    from vllm.distributed import tensor_model_parallel_all_reduce
    return tensor_model_parallel_all_reduce(x)
