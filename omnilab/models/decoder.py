"""Qwen3 decoder stack shared by the talker and the code predictor, with an explicit KV cache.

Contract: numerics follow the reference (transformers Qwen3 / qwen-tts with ``attn_implementation="sdpa"``)
operation for operation, so greedy codes match the official implementation: pre-norm RMSNorm (fp32
upcast), q/k projections -> per-head q_norm/k_norm -> RoPE (rotate-half, tables built in fp32 and cast) ->
SDPA with scale ``head_dim**-0.5`` and ``enable_gqa``, SwiGLU MLP, residual adds. M-RoPE with identical
t/h/w positions (all TTS prompts) equals this 1-D RoPE bit for bit.

KV caches are preallocated ``[B, kv_heads, capacity, head_dim]`` per layer and written in place.
:class:`KVCache` rows advance in lockstep (one ``length``); the talker keeps one single-row cache per
request and passes a list of them, so each row attends only to its own history (no padding masks).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omnilab.config import DecoderLMConfig
from omnilab.kernels import linear
from omnilab.kernels.attention import decode_attention
from omnilab.kernels.norm import rms_norm  # the kernel (one call per norm) or the reference's ops
from omnilab.models.decode_step import DecodeStep, StackStep
from omnilab.models.layers import Linear, RMSNorm, SwiGLU
from omnilab.tuning.fuse import FusedProjection


class KVCache:
    """Per-layer key/value buffers ``[B, kv_heads, capacity, head_dim]``; ``length`` positions are valid.

    ``capacity`` grows by doubling when a write would overflow (``grow=True``), so callers may start
    small. All rows share one length (the code predictor batch, or one talker request with B = 1).
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", grow: bool = True):
        shape = (batch, num_kv_heads, max(int(capacity), 1), head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0
        self.grow = grow

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self) -> None:
        self.length = 0

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` positions in total (copying the valid prefix when growing)."""
        if needed <= self.capacity:
            return
        if not self.grow:
            raise RuntimeError(f"KV cache capacity {self.capacity} < {needed} positions")
        cap = self.capacity
        while cap < needed:
            cap *= 2
        for buf in (self.k, self.v):
            for i, t in enumerate(buf):
                new = t.new_zeros(t.shape[0], t.shape[1], cap, t.shape[3])
                new[:, :, : self.length] = t[:, :, : self.length]
                buf[i] = new

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` ``[B, kv, T, D]`` at ``length`` and return views of the valid keys/values."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class RopeTable:
    """Cached fp32 cos/sin rows for positions ``0..capacity-1`` (grown on demand).

    Each row equals what :class:`omnilab.models.layers.RotaryEmbedding` computes for that position
    (same ``inv_freq``, same elementwise ops), so a lookup is bitwise identical to recomputing.
    """

    def __init__(self, head_dim: int, theta: float):
        self.head_dim = head_dim
        # Explicit CPU device: the table must be real even when the model is built under torch.device("meta").
        ar = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
        self.inv_freq = 1.0 / (theta ** (ar.float() / head_dim))
        self._cos = torch.empty(0, head_dim, device="cpu")
        self._sin = torch.empty(0, head_dim, device="cpu")
        self._cast: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def _ensure(self, n: int) -> None:
        if n <= self._cos.shape[0]:
            return
        cap = max(64, self._cos.shape[0])
        while cap < n:
            cap *= 2
        pos = torch.arange(cap, dtype=torch.int64, device="cpu")[None, :]  # [1, cap]
        inv = self.inv_freq[None, :, None].float()
        freqs = (inv @ pos[:, None, :].float()).transpose(1, 2)  # [1, cap, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[0]
        self._cos, self._sin = emb.cos(), emb.sin()
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, D/2) * cat(-sin[:D/2], sin[D/2:]) exactly (sign-symmetric products)
        self._sin_signed = torch.cat((-self._sin[:, :half], self._sin[:, half:]), dim=-1)
        self._cast.clear()

    def _tables(self, n: int, dtype: torch.dtype, device: torch.device | str, signed: bool):
        self._ensure(n)
        key = (dtype, torch.device(device), signed)
        tabs = self._cast.get(key)
        if tabs is None:
            tabs = (self._cos.to(device=device, dtype=dtype),
                    (self._sin_signed if signed else self._sin).to(device=device, dtype=dtype))
            self._cast[key] = tabs
        return tabs

    def get(self, positions: torch.Tensor, dtype: torch.dtype,
            signed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [B, T] int64 -> (cos, sin) each ``[B, T, head_dim]`` in ``dtype``
        (``signed``: sin with its first half negated, for :func:`rope_rows`)."""
        cos, sin = self._tables(int(positions.max()) + 1, dtype, positions.device, signed)
        return cos[positions], sin[positions]

    def span(self, start: int, length: int, dtype: torch.dtype, device: torch.device | str = "cpu",
             signed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous positions ``start..start+length-1`` -> (cos, sin) ``[1, length, head_dim]``."""
        cos, sin = self._tables(start + length, dtype, device, signed)
        return cos[None, start:start + length], sin[None, start:start + length]




Caches = KVCache | Sequence[KVCache] | None


class Attention(nn.Module):
    """Qwen3 attention: released names ``{q,k,v,o}_proj``, ``{q,k}_norm`` (RMSNorm over head_dim)."""

    def __init__(self, cfg: DecoderLMConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.scale = d ** -0.5
        bias = cfg.attention_bias
        self.q_proj = Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self._qkv = FusedProjection()  # q/k/v in one kernel call at decode (omnilab.tuning.fuse)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [..., H] -> q [..., Hq*D], k, v [..., Hkv*D]: one fused kernel call where the decode kernels
        take it (bitwise the separate calls), else one linear each."""
        qkv = self._qkv(x, (self.q_proj, self.k_proj, self.v_proj))
        if qkv is not None:
            return qkv
        return (linear(x, self.q_proj.weight, self.q_proj.bias), linear(x, self.k_proj.weight, self.k_proj.bias),
                linear(x, self.v_proj.weight, self.v_proj.bias))

    def _qk_weight(self) -> torch.Tensor:
        """q_norm and k_norm weights stacked per head ``[Hq + Hkv, D]`` (rebuilt when they change)."""
        qw, kw = self.q_norm.weight, self.k_norm.weight
        key = (qw.data_ptr(), qw._version, kw.data_ptr(), kw._version, qw.dtype)
        if getattr(self, "_qk_key", None) != key:
            self._qk_w = torch.cat([qw.expand(self.num_heads, -1), kw.expand(self.num_kv_heads, -1)])
            self._qk_key = key
        return self._qk_w

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, layer: int,
                caches: Caches) -> torch.Tensor:
        """``x`` [B, T, H]; ``cos``/``sin_signed`` [B, T, D] from :meth:`RopeTable.span` (``signed=True``).

        q and k are normalised and rotated together (one [B, T, Hq+Hkv, D] tensor): every element sees
        exactly the reference's operations, in fewer kernel launches."""
        b, t, _ = x.shape
        hq, d = self.num_heads, self.head_dim
        mods = (self.q_proj, self.k_proj, self.v_proj)
        qkv = self._qkv.output(x, mods)  # [B, T, (Hq + 2 Hkv) * D] from one kernel call, or None
        if qkv is not None and t == 1 and caches is not None:  # one token per row: omnilab.kernels.attention
            out = self._decode(qkv, cos, sin_signed, layer, caches)
            if out is not None:
                return linear(out, self.o_proj.weight, self.o_proj.bias)
        q, k, v = qkv.split(self._qkv.sizes, dim=-1) if qkv is not None else self.project(x)
        q, k = q.view(b, t, hq, d), k.view(b, t, self.num_kv_heads, d)
        v = v.view(b, t, -1, d).transpose(1, 2)
        qk = rms_norm(torch.cat([q, k], dim=2), self._qk_weight(), self.q_norm.eps)  # [B, T, Hq+Hkv, D]
        qk = qk * cos[:, :, None] + torch.roll(qk, d // 2, dims=-1) * sin_signed[:, :, None]
        q, k = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2)  # [B, heads, T, D]
        if caches is None:
            out = self._sdpa(q, k, v, start=0)
        elif isinstance(caches, KVCache):
            start = caches.length
            k_all, v_all = caches.write(layer, k, v)
            out = self._sdpa(q, k_all, v_all, start)
        else:  # one single-row cache per batch row
            rows = []
            for i, c in enumerate(caches):
                start = c.length
                k_all, v_all = c.write(layer, k[i:i + 1], v[i:i + 1])
                rows.append(self._sdpa(q[i:i + 1], k_all, v_all, start))
            out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
        out = out.transpose(1, 2).reshape(b, t, -1)  # [B, T, Hq*D]
        return linear(out, self.o_proj.weight, self.o_proj.bias)

    def _decode(self, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, layer: int,
                caches: KVCache | Sequence[KVCache]) -> torch.Tensor | None:
        """The one-token attention kernel over the fused ``qkv`` [B, 1, N]: writes k/v into the caches at their
        lengths and returns [B, 1, Hq*D], or None where the kernel does not apply."""
        if isinstance(caches, KVCache):
            kb, vb = caches.k[layer], caches.v[layer]  # [B, Hkv, cap, D]
            k_bufs, v_bufs = [kb[i] for i in range(kb.shape[0])], [vb[i] for i in range(vb.shape[0])]
            positions = [caches.length] * kb.shape[0]
        else:
            k_bufs, v_bufs = [c.k[layer][0] for c in caches], [c.v[layer][0] for c in caches]
            positions = [c.length for c in caches]
        return decode_attention(qkv, self._qk_weight(), self.q_norm.eps, cos, sin_signed, k_bufs, v_bufs, positions,
                                self.num_heads, self.num_kv_heads, self.head_dim, self.scale)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        t, s = q.shape[2], k.shape[2]
        if t == 1 or start == 0:
            # The reference passes no mask here: is_causal for a fresh multi-token chunk, none for 1 query.
            return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=self.scale, enable_gqa=True)
        # Chunked prefill on top of a cache: explicit causal mask offset by ``start``.
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=start)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (released tensor names)."""

    def __init__(self, cfg: DecoderLMConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._step = DecodeStep()  # the one-token step as direct kernel calls (omnilab.models.decode_step)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, layer: int,
                caches: Caches) -> torch.Tensor:
        if x.shape[1] == 1 and caches is not None:  # decode: bitwise the path below, in fewer Python steps
            y = self._step(self, x, cos, sin_signed, layer, caches)
            if y is not None:
                return y
        # Functional calls (no nn.Module __call__): the per-op overhead matters at batch 1.
        ln1, ln2, mlp = self.input_layernorm, self.post_attention_layernorm, self.mlp
        x = x + self.self_attn.forward(rms_norm(x, ln1.weight, ln1.eps), cos, sin_signed, layer, caches)
        return x + mlp.forward(rms_norm(x, ln2.weight, ln2.eps))


SHORT_PREFILL_TOKENS = 4  # prefills of up to this many tokens per sequence take the one-call stack (see run_stack)


def _stack(layers: nn.ModuleList) -> StackStep:
    stack = layers.__dict__.get("_stack_step")
    if stack is None:
        stack = layers._stack_step = StackStep()
    return stack


def run_stack(layers: nn.ModuleList, norm: RMSNorm, rope: RopeTable, x: torch.Tensor, caches: Caches,
              recheck: bool = True) -> torch.Tensor:
    """Run ``x`` [B, T, H] through ``layers`` + final ``norm``; advance the caches by T.

    Positions continue from each cache's length (0 when ``caches`` is None). ``recheck=False``: no weight changed
    since the previous call (see :class:`~omnilab.models.decode_step.StackStep`)."""
    t = x.shape[1]
    if caches is None:
        cos, sin = rope.span(0, t, x.dtype, x.device, signed=True)
    elif isinstance(caches, KVCache):
        caches.reserve(caches.length + t)
        cos, sin = rope.span(caches.length, t, x.dtype, x.device, signed=True)
    else:
        if len(caches) != x.shape[0]:
            raise ValueError(f"{len(caches)} caches for a batch of {x.shape[0]} rows")
        for c in caches:
            c.reserve(c.length + t)
        if len(caches) == 1:
            cos, sin = rope.span(caches[0].length, t, x.dtype, x.device, signed=True)
        else:
            starts = torch.tensor([c.length for c in caches], dtype=torch.int64, device=x.device)
            cos, sin = rope.get(starts[:, None] + torch.arange(t, device=x.device)[None, :], x.dtype, signed=True)
    y = None
    if t == 1 and caches is not None:  # decode: the whole stack in one kernel call where it applies (bitwise)
        y = _stack(layers)(layers, norm, x, cos, sin, caches, recheck)
    elif 1 < t <= SHORT_PREFILL_TOKENS and isinstance(caches, KVCache) and x.is_contiguous():
        # a short prefill (the code predictor's first step: [h, C(c0)] per row): every token a row of the one-call
        # stack over its sequence's cache row (StackStep's tokens: causal by the kernel's write-then-attend)
        b = x.shape[0]
        rows = lambda tab: tab.expand(b, t, tab.shape[-1]).reshape(b * t, -1)  # noqa: E731  [B*T, D]
        y = _stack(layers)(layers, norm, x.view(b * t, 1, -1), rows(cos), rows(sin), caches, recheck, tokens=t)
        y = None if y is None else y.view(b, t, -1)
    if y is None:
        for i, layer in enumerate(layers):
            x = layer.forward(x, cos, sin, i, caches)
    if isinstance(caches, KVCache):
        caches.length += t
    elif caches is not None:
        for c in caches:
            c.length += t
    return y if y is not None else rms_norm(x, norm.weight, norm.eps)
