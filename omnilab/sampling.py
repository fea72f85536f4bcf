"""Sampling parameters and logits processing with the reference (HF ``generate``) semantics.

Contract:
- :class:`SamplingParams` is frozen; build it with :meth:`SamplingParams.from_defaults` (``generation_config.json``
  values + user overrides) and check it with :meth:`SamplingParams.validate`, which raises
  :class:`~omnilab.errors.InputError` naming the field and the accepted range.
- Talker (codebook 0), in HF order (docs/model.md#talker-sampling): logits cast to fp32 -> repetition penalty over the
  request's previously *generated* c0 tokens (never the prompt) -> EOS masked while fewer than
  ``min_new_tokens`` tokens were generated -> ids ``>= 2048`` except codec EOS suppressed -> if sampling:
  temperature -> top-k -> top-p -> softmax -> ``torch.multinomial`` with the request's generator;
  otherwise argmax.
- Sub-talker (codebooks 1..15): the same warpers with its own values; no penalty, no EOS.
Rows are processed independently, so a row's result does not depend on its batch mates.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from omnilab.config import CODEBOOK_SIZE, GenerationDefaults
from omnilab.errors import InputError

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Warp:
    """The HF warpers of one sampler. ``top_k`` 0 = off; ``top_p`` 1.0 = off."""
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_do_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    max_new_tokens: int = 2048
    min_new_tokens: int = 2
    seed: int | None = None

    # Accepted alternative spellings (the official package's keyword names).
    _ALIASES = {"subtalker_dosample": "subtalker_do_sample"}

    @classmethod
    def from_defaults(cls, defaults: GenerationDefaults | None = None, **overrides: Any) -> "SamplingParams":
        """``generation_config.json`` values, replaced by every override that is not None."""
        d = defaults if defaults is not None else GenerationDefaults()
        base = dict(do_sample=d.do_sample, temperature=d.temperature, top_k=d.top_k, top_p=d.top_p,
                    repetition_penalty=d.repetition_penalty, subtalker_do_sample=d.subtalker_dosample,
                    subtalker_temperature=d.subtalker_temperature, subtalker_top_k=d.subtalker_top_k,
                    subtalker_top_p=d.subtalker_top_p, max_new_tokens=d.max_new_tokens)
        names = {f.name for f in dataclasses.fields(cls)}
        for key, value in overrides.items():
            name = cls._ALIASES.get(key, key)
            if name not in names:
                raise InputError(f"unknown sampling option {key!r}; accepted: {', '.join(sorted(names))}")
            if value is not None:
                base[name] = value
        return cls(**base)

    def validate(self, max_new_tokens_limit: int) -> "SamplingParams":
        """Raise :class:`InputError` for the first out-of-range field; return ``self``."""
        for name in ("do_sample", "subtalker_do_sample"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be True or False (got {getattr(self, name)!r})")
        for prefix in ("", "subtalker_"):
            t = getattr(self, prefix + "temperature")
            if not _is_real(t) or not math.isfinite(t) or t <= 0:
                raise InputError(f"{prefix}temperature must be a finite number > 0 (got {t!r})")
            k = getattr(self, prefix + "top_k")
            if not _is_int(k) or k < 0:
                raise InputError(f"{prefix}top_k must be an integer >= 0, 0 = off (got {k!r})")
            p = getattr(self, prefix + "top_p")
            if not _is_real(p) or not (0 < p <= 1):
                raise InputError(f"{prefix}top_p must be in (0, 1], 1.0 = off (got {p!r})")
        rp = self.repetition_penalty
        if not _is_real(rp) or not math.isfinite(rp) or rp <= 0:
            raise InputError(f"repetition_penalty must be a finite number > 0, 1.0 = off (got {rp!r})")
        n = self.max_new_tokens
        if not _is_int(n) or not (1 <= n <= max_new_tokens_limit):
            raise InputError(f"max_new_tokens must be an integer in [1, {max_new_tokens_limit}] (got {n!r})")
        m = self.min_new_tokens
        if not _is_int(m) or m < 0:
            raise InputError(f"min_new_tokens must be an integer >= 0 (got {m!r})")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed <= MAX_SEED)):
            raise InputError(f"seed must be None or an integer in [0, 2**63 - 1] (got {self.seed!r})")
        return self

    @property
    def talker_warp(self) -> Warp:
        return Warp(self.do_sample, float(self.temperature), int(self.top_k), float(self.top_p))

    @property
    def subtalker_warp(self) -> Warp:
        return Warp(self.subtalker_do_sample, float(self.subtalker_temperature), int(self.subtalker_top_k),
                    float(self.subtalker_top_p))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# ---- logits processing ---------------------------------------------------------------------------

_SUPPRESS_CACHE: dict[tuple[int, int, str], torch.Tensor] = {}


def suppress_mask(vocab_size: int, eos_id: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool ``[vocab]``: True for ids the talker may never emit (2048..vocab-1 except EOS)."""
    key = (vocab_size, eos_id, str(device))
    mask = _SUPPRESS_CACHE.get(key)
    if mask is None:
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        mask[CODEBOOK_SIZE:] = True
        mask[eos_id] = False
        _SUPPRESS_CACHE[key] = mask
    return mask


def talker_scores(logits: torch.Tensor, histories: Sequence[Sequence[int] | torch.Tensor],
                  params: Sequence[SamplingParams], eos_id: int) -> torch.Tensor:
    """``logits`` [B, V] -> fp32 scores after repetition penalty, min_new_tokens and suppression.

    ``histories[b]``: the c0 tokens row b generated so far (the prompt is not included)."""
    scores = logits.to(dtype=torch.float32, copy=True)
    for b, (hist, p) in enumerate(zip(histories, params)):
        n = len(hist)
        if n and p.repetition_penalty != 1.0:
            idx = torch.as_tensor(hist, dtype=torch.long, device=scores.device)[None]  # [1, n]
            row = scores[b:b + 1]
            s = torch.gather(row, 1, idx)
            s = torch.where(s < 0, s * p.repetition_penalty, s / p.repetition_penalty)
            row.scatter_(1, idx, s)
        if n < p.min_new_tokens:
            scores[b, eos_id] = -math.inf
    return scores.masked_fill_(suppress_mask(scores.shape[-1], eos_id, scores.device), -math.inf)


def warp_scores(scores: torch.Tensor, warp: Warp) -> torch.Tensor:
    """HF warpers in order: temperature (if != 1) -> top-k (if > 0) -> top-p (if < 1). ``[B, V]``."""
    if warp.temperature != 1.0:
        scores = scores / warp.temperature
    if warp.top_k > 0:
        k = min(warp.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -math.inf)
    if warp.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - warp.top_p)
        remove_sorted[..., -1:] = False  # keep at least one token
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, -math.inf)
    return scores


def sample_rows(scores: torch.Tensor, warps: Sequence[Warp],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Pick one id per row of fp32 ``scores`` [B, V] -> ``[B]`` int64.

    Greedy rows take the argmax; sampling rows are warped (rows with equal warps together) and drawn
    with ``torch.multinomial`` on that row's generator (one call per row, as HF does for batch 1)."""
    b = scores.shape[0]
    if all(not w.do_sample for w in warps):
        return torch.argmax(scores, dim=-1)
    out = torch.empty(b, dtype=torch.long, device=scores.device)
    groups: dict[Warp, list[int]] = {}
    for i, w in enumerate(warps):
        groups.setdefault(w, []).append(i)
    for w, rows in groups.items():
        sub = scores if len(rows) == b else scores[rows]
        if not w.do_sample:
            out[rows] = torch.argmax(sub, dim=-1)
            continue
        probs = torch.softmax(warp_scores(sub, w), dim=-1)
        for j, i in enumerate(rows):
            out[i] = torch.multinomial(probs[j:j + 1], num_samples=1, generator=generators[i])[0, 0]
    return out
