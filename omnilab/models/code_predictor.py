"""Code predictor ("sub-talker"): a 5-layer Qwen3 decoder that turns (talker hidden, c0) into c1..c15.

Contract: parameter names equal the released ``talker.code_predictor.*`` names with ``talker.code_predictor.``
stripped: ``model.codec_embedding.{0..14}`` (talker width), ``model.layers.{0..4}.*``, ``model.norm``,
``lm_head.{0..14}`` and, only when talker width != predictor width (1.7B),
``small_to_mtp_projection.{weight,bias}``.

:meth:`CodePredictor.generate` is KV-cached and batched: one forward over 2 positions ``[h, C(c0)]``, then
14 single-position forwards (positions 0..15), ``lm_head[j]`` at step j, sampling per row with each row's
own generator (docs/model.md#code-predictor). It never re-prefills. Numerics mirror the reference (logits of the first
step are computed for both positions, as HF ``generate`` does, and cast to fp32 before sampling).
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omnilab.config import NUM_CODE_GROUPS, Qwen3TTSConfig
from omnilab.kernels import linear
from omnilab.models.decoder import DecoderLayer, KVCache, RopeTable, run_stack
from omnilab.models.layers import Linear, RMSNorm
from omnilab.sampling import Warp, sample_rows

NUM_PREDICTED = NUM_CODE_GROUPS - 1  # 15 codes per frame come from the predictor


class CodePredictorModel(nn.Module):
    """``code_predictor.model.*``: 15 codec embeddings (talker width), layers, final norm."""

    def __init__(self, cfg: Qwen3TTSConfig):
        super().__init__()
        pc = cfg.code_predictor
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(pc.vocab_size, cfg.talker.hidden_size) for _ in range(NUM_PREDICTED))
        self.layers = nn.ModuleList(DecoderLayer(pc) for _ in range(pc.num_hidden_layers))
        self.norm = RMSNorm(pc.hidden_size, eps=pc.rms_norm_eps)


class CodePredictor(nn.Module):
    def __init__(self, cfg: Qwen3TTSConfig):
        super().__init__()
        pc = cfg.code_predictor
        self.cfg = cfg
        self.model = CodePredictorModel(cfg)
        self.lm_head = nn.ModuleList(Linear(pc.hidden_size, pc.vocab_size, bias=False)
                                     for _ in range(NUM_PREDICTED))
        if cfg.has_mtp_projection:
            self.small_to_mtp_projection = Linear(cfg.talker.hidden_size, pc.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()
        self.rope = RopeTable(pc.head_dim, pc.rope_theta)
        self._caches: dict[tuple[int, torch.dtype], KVCache] = {}

    def _cache(self, batch: int) -> KVCache:
        w = self.model.norm.weight  # compute dtype (matrices may be stored in bf16)
        key = (batch, w.dtype)
        cache = self._caches.get(key)
        if cache is None:
            pc = self.cfg.code_predictor
            cache = KVCache(pc.num_hidden_layers, batch, pc.num_key_value_heads, pc.head_dim,
                            NUM_CODE_GROUPS, dtype=w.dtype, device=w.device, grow=False)
            self._caches[key] = cache
        cache.reset()
        return cache

    def _apply(self, fn, *args, **kwargs):  # dtype/device moves invalidate the preallocated caches
        self._caches.clear()
        return super()._apply(fn, *args, **kwargs)

    @torch.inference_mode()
    def generate(self, h: torch.Tensor, c0_embed: torch.Tensor, warps: Warp | Sequence[Warp],
                 generators: Sequence[torch.Generator | None] | None = None,
                 timings: dict[str, float] | None = None, return_logits: bool = False,
                 forced: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``h`` [B, H] (talker final-norm hidden that produced c0), ``c0_embed`` [B, H] = ``C(c0)``
        -> codes c1..c15 ``[B, 15]`` (int64).

        ``warps``: one :class:`~omnilab.sampling.Warp` for all rows or one per row; greedy rows take the
        argmax. ``generators``: one per row (None = the global RNG). ``timings`` (optional) receives
        ``sampling_ms`` spent inside the loop. ``return_logits``: also return the raw fp32 logits
        ``[B, 15, 2048]`` (for tests). ``forced`` ``[B, 15]`` int64 (teacher forcing, :mod:`omnilab.quality`):
        step j > 0 is fed ``forced[:, j-1]`` instead of the row's own pick; the picks are still returned."""
        b = h.shape[0]
        if isinstance(warps, Warp):
            warps = [warps] * b
        gens = list(generators) if generators is not None else [None] * b
        if len(warps) != b or len(gens) != b:
            raise ValueError(f"need {b} warps and generators, got {len(warps)} and {len(gens)}")
        proj = self.small_to_mtp_projection
        layers, norm = self.model.layers, self.model.norm
        tables = [e.weight for e in self.model.codec_embedding]
        heads = [m.weight for m in self.lm_head]
        if forced is not None and tuple(forced.shape) != (b, NUM_PREDICTED):
            raise ValueError(f"forced codes must be [{b}, {NUM_PREDICTED}], got {tuple(forced.shape)}")
        cache = self._cache(b)
        codes = torch.empty(b, NUM_PREDICTED, dtype=torch.long, device=h.device)
        sample_s = 0.0
        all_logits = [] if return_logits else None

        x = proj(torch.stack([h, c0_embed], dim=1))  # [B, 2, Hc]
        hidden = run_stack(layers, norm, self.rope, x, cache)
        logits = linear(hidden, heads[0])[:, -1]  # both positions, like HF generate (same rounding)
        for j in range(NUM_PREDICTED):
            if j > 0:
                fed = codes if forced is None else forced
                x = proj(F.embedding(fed[:, j - 1:j], tables[j - 1]))  # [B, 1, Hc]
                # the weights cannot change between the steps of one frame: checked at its first one-token step
                hidden = run_stack(layers, norm, self.rope, x, cache, recheck=j == 1)
                logits = linear(hidden[:, -1], heads[j])
            if all_logits is not None:
                all_logits.append(logits.float())
            t0 = time.perf_counter()
            codes[:, j] = sample_rows(logits.float(), warps, gens)
            sample_s += time.perf_counter() - t0
        if timings is not None:
            timings["sampling_ms"] = timings.get("sampling_ms", 0.0) + 1e3 * sample_s
        if all_logits is not None:
            return codes, torch.stack(all_logits, dim=1)
        return codes
