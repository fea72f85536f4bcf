"""The talker: a 28-layer Qwen3 decoder over summed text-track + codec-track embeddings -> codebook 0.

Contract: parameter names equal the released ``talker.*`` tensor names with the ``talker.`` prefix
stripped (docs/model.md#tensor-names-and-prefix-stripping), so ``load_state_dict(strict=True)`` works on a real checkpoint. The module
does forward passes only; sampling and the per-frame loop live in :mod:`omnilab.stages.eager`.

Embeddings (docs/model.md#talker-embeddings): ``T(ids) = text_projection(text_embedding(ids))`` (SiLU MLP with biases),
``C(id) = model.codec_embedding(id)``, and a frame's input vector is
``C(c0) + sum_q E_q(c_q)`` with ``E_q = code_predictor.model.codec_embedding[q-1]`` (talker width).
To stay bit-faithful to the reference, callers should group ids into the same ``embed_text`` calls as
the official prompt builder (a Linear over M rows may round differently for M = 1).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omnilab.config import Qwen3TTSConfig
from omnilab.models.code_predictor import CodePredictor
from omnilab.models.decoder import DecoderLayer, KVCache, RopeTable, run_stack
from omnilab.models.layers import Linear, RMSNorm


class TextProjection(nn.Module):
    """``linear_fc2(silu(linear_fc1(x)))``: text width (2048) -> talker width, with biases."""

    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(nn.Module):
    """``talker.model.*``: embeddings, decoder layers and the final norm."""

    def __init__(self, cfg: Qwen3TTSConfig):
        super().__init__()
        tc = cfg.talker
        self.codec_embedding = nn.Embedding(tc.vocab_size, tc.hidden_size)
        self.text_embedding = nn.Embedding(tc.text_vocab_size, tc.text_hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(tc) for _ in range(tc.num_hidden_layers))
        self.norm = RMSNorm(tc.hidden_size, eps=tc.rms_norm_eps)


class Talker(nn.Module):
    """Talker LM + its code predictor. ``forward`` returns final-norm hidden states."""

    def __init__(self, cfg: Qwen3TTSConfig):
        super().__init__()
        tc = cfg.talker
        self.cfg = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(tc.text_hidden_size, tc.hidden_size)
        self.codec_head = Linear(tc.hidden_size, tc.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg)
        # M-RoPE with identical t/h/w positions == 1-D RoPE (docs/model.md#m-rope-equals-1-d-rope).
        self.rope = RopeTable(tc.head_dim, tc.rope_theta)

    # ---- embeddings ---------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype (the final norm's: decode matrices may be stored in bf16 under fp32 compute)."""
        return self.model.norm.weight.dtype

    @property
    def hidden_size(self) -> int:
        return self.cfg.talker.hidden_size

    @torch.inference_mode()
    def embed_text(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Text-track vectors ``T(ids)`` -> ``[N, H]`` (one projection call over all N rows)."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        return self.text_projection(self.model.text_embedding(ids))

    @torch.inference_mode()
    def embed_codec(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Codec-track rows ``C(ids)`` -> ``[N, H]``."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        return self.model.codec_embedding(ids)

    @torch.inference_mode()
    def embed_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` [B, 16] -> ``C(c0) + sum_{q=1..15} E_q(c_q)`` ``[B, H]``.

        Stacks the 16 vectors to ``[B, 16, H]`` and sums over dim 1, as the reference does."""
        tables = self.code_predictor.model.codec_embedding
        parts = [self.model.codec_embedding(codes[:, 0])]
        parts += [tables[q - 1](codes[:, q]) for q in range(1, codes.shape[1])]
        return torch.stack(parts, dim=1).sum(1)

    # ---- network --------------------------------------------------------------------------------
    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        tc = self.cfg.talker
        return KVCache(tc.num_hidden_layers, batch, tc.num_key_value_heads, tc.head_dim, capacity,
                       dtype=self.dtype, device=self.codec_head.weight.device)

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, caches: KVCache | Sequence[KVCache] | None = None) -> torch.Tensor:
        """``embeds`` [B, T, H] -> final-norm hidden ``[B, T, H]``.

        ``caches``: None (fresh causal pass, positions 0..T-1, nothing kept), one :class:`KVCache`
        whose B rows advance together, or a list of B single-row caches (each row continues from its
        own length; used to batch decode steps of requests with different histories)."""
        return run_stack(self.model.layers, self.model.norm, self.rope, embeds, caches)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``codec_head``: ``[..., H]`` -> ``[..., vocab]`` (model dtype)."""
        return self.codec_head(hidden)


@torch.no_grad()
def init_random_(talker: Talker, generator: torch.Generator, std: float | None = None) -> Talker:
    """Fill every parameter in place like the reference ``_init_weights``: Linear/Embedding weights
    ~ Normal(0, ``initializer_range`` = 0.02), biases 0, RMSNorm weights 1. Deterministic given the
    generator's state (parameters are visited in registration order)."""
    std = 0.02 if std is None else std
    for module in talker.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            w = module.weight
            if w.dtype == torch.float32:
                w.normal_(0.0, std, generator=generator)
            else:  # draw in fp32 so the values do not depend on the storage dtype
                w.copy_(torch.empty(w.shape, dtype=torch.float32).normal_(0.0, std, generator=generator))
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
    return talker
