"""Building blocks of the Mimi encoder: the encoder transformer and the split residual vector quantizer.

Contract: ``nn.Module`` parts used by :class:`~omnilab.models.mimi_encoder.MimiEncoder`, each built from a
``MimiEncoderConfig``; their submodule / parameter / buffer names are part of the released checkpoint's
``encoder.*`` keys and must not change.
- ``_Transformer(cfg)(x [B, T, H], window)``: pre-LayerNorm layers (``_TransformerLayer``: ``_Attention``
  with RoPE and MHA/GQA, ``_MLP`` fc1/fc2, ``_LayerScale`` on both residual branches); plain causal
  attention when ``window`` is None, else the sliding-window mask.
- ``_SplitRVQ(cfg).encode(x [B, H, T], n_q) -> codes [B, n_q, T]``: the semantic RVQ (first
  ``num_semantic_quantizers`` codes) then the acoustic one; each ``_RVQ`` has its own 1x1 ``input_proj``
  (``output_proj`` kept for the keys only) and ``_VQ`` / ``_Codebook`` EMA buffers (entries =
  ``embed_sum / clamp(cluster_usage, 1e-5)``, nearest by ``torch.cdist`` as in the reference).
- ``_ACTS``: the accepted ``hidden_act`` names.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from omnilab.models.layers import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from omnilab.models.mimi_encoder import MimiEncoderConfig


_ACTS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}  # transformers ACT2FN["gelu"] is the exact (erf) GELU


# ----------------------------------------------------------------------------------------- transformer

class _Attention(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        hd, nh, nkv = cfg.attn_head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.n_heads, self.n_kv = hd, nh, nkv
        self.q_proj = nn.Linear(cfg.hidden_size, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:  # x [B, T, H]
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, k, cos, sin)
        if self.n_kv != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _LayerScale(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        self.scale = nn.Parameter(torch.full((cfg.hidden_size,), cfg.layer_scale_initial_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class _TransformerLayer(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn_layer_scale = _LayerScale(cfg)
        self.mlp_layer_scale = _LayerScale(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class _Transformer(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(_TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.rotary = RotaryEmbedding(cfg.attn_head_dim, cfg.rope_theta)  # inv_freq is not persistent

    def forward(self, x: torch.Tensor, window: int | None) -> torch.Tensor:  # [B, T, H]
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)[None]
        cos, sin = self.rotary(pos, x.dtype)
        mask = None
        if window is not None and t > window:
            d = pos[0][:, None] - pos[0][None, :]  # query - key
            mask = (d >= 0) & (d < window)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x


# ------------------------------------------------------------------------------------------- quantizer

class _Codebook(nn.Module):
    """EMA codebook buffers (persistent, as in the checkpoint). Entries = embed_sum / clamp(usage, 1e-5)."""

    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(cfg.codebook_size))
        self.register_buffer("embed_sum", torch.zeros(cfg.codebook_size, cfg.codebook_dim))

    def embed(self) -> torch.Tensor:  # [K, D]
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _VQ(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        self.codebook = _Codebook(cfg)


class _RVQ(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig, n_q: int):
        super().__init__()
        self.layers = nn.ModuleList(_VQ(cfg) for _ in range(n_q))
        self.input_proj = self.output_proj = None
        if cfg.vector_quantization_hidden_dimension != cfg.hidden_size:
            d = cfg.vector_quantization_hidden_dimension
            self.input_proj = nn.Conv1d(cfg.hidden_size, d, 1, bias=False)
            self.output_proj = nn.Conv1d(d, cfg.hidden_size, 1, bias=False)  # decode only; kept for the keys

    def encode(self, x: torch.Tensor, n_q: int) -> torch.Tensor:  # x [B, H, T] -> codes [B, n_q, T]
        if self.input_proj is not None:
            x = self.input_proj(x)
        residual = x.transpose(1, 2)  # [B, T, D]
        b, t, d = residual.shape
        codes = []
        for vq in self.layers[:n_q]:
            table = vq.codebook.embed()
            # torch.cdist as in the reference, so near-ties resolve the same way
            idx = torch.cdist(residual.reshape(1, b * t, d).float(), table[None].float(), p=2)[0].argmin(dim=-1)
            idx = idx.view(b, t)
            residual = residual - F.embedding(idx, table)
            codes.append(idx)
        return torch.stack(codes, dim=1)


class _SplitRVQ(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig):
        super().__init__()
        self.n_sem = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = _RVQ(cfg, cfg.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = _RVQ(cfg, cfg.num_quantizers - cfg.num_semantic_quantizers)

    def encode(self, x: torch.Tensor, n_q: int) -> torch.Tensor:  # [B, H, T] -> [B, n_q, T]
        codes = self.semantic_residual_vector_quantizer.encode(x, min(n_q, self.n_sem))
        if n_q > self.n_sem:
            acoustic = self.acoustic_residual_vector_quantizer.encode(x, n_q - self.n_sem)
            codes = torch.cat([codes, acoustic], dim=1)
        return codes
