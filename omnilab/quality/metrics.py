"""The fidelity numbers, from tensors and arrays (docs/quality.md#metrics).

Contract (each function is pure and documented with its formula):

- :func:`top1_agreement`: fraction of positions where two ``[T, V]`` score rows have the same argmax.
- :func:`kl_per_frame`: ``KL(p || q)`` per row, ``p = softmax(ref)``, ``q = softmax(test)``, in nats, computed in
  float64; ids that both sides score ``-inf`` (suppressed) contribute 0; an id that only ``test`` suppresses
  where ``p > 0`` gives ``inf`` (the test model can never emit what the reference might).
- :func:`code_agreement`: per-codebook fraction of equal codes of two ``[T, K]`` code arrays.
- :func:`wave_snr_db`: ``10 log10(sum ref^2 / sum (ref - test)^2)`` in float64; ``inf`` when the waves are equal.
All return NaN for zero positions instead of raising: a request can end before its first frame.
"""
from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["code_agreement", "kl_per_frame", "top1_agreement", "wave_snr_db"]


def top1_agreement(ref_scores: torch.Tensor, test_scores: torch.Tensor) -> float:
    """``ref_scores``, ``test_scores`` ``[T, V]`` -> mean of ``argmax(ref) == argmax(test)`` over the T rows."""
    if ref_scores.shape != test_scores.shape:
        raise ValueError(f"score shapes differ: {tuple(ref_scores.shape)} vs {tuple(test_scores.shape)}")
    if ref_scores.shape[0] == 0:
        return math.nan
    return float((ref_scores.argmax(-1) == test_scores.argmax(-1)).double().mean())


def kl_per_frame(ref_scores: torch.Tensor, test_scores: torch.Tensor) -> np.ndarray:
    """``[T, V]`` scores -> ``KL(softmax(ref) || softmax(test))`` per row ``[T]`` float64 (nats, >= 0).

    Rounding can leave a sum a few ulps below zero when the rows are nearly equal; such values are reported
    as 0 (KL is non-negative by definition, and equal rows give exactly 0 without clamping)."""
    if ref_scores.shape != test_scores.shape:
        raise ValueError(f"score shapes differ: {tuple(ref_scores.shape)} vs {tuple(test_scores.shape)}")
    lp = torch.log_softmax(ref_scores.double(), dim=-1)  # [T, V]
    lq = torch.log_softmax(test_scores.double(), dim=-1)
    p = lp.exp()
    diff = torch.where(p > 0, lp - lq, torch.zeros_like(lp))  # p = 0 terms are 0 (and -inf - -inf is no NaN)
    kl = (p * diff).sum(-1)
    return kl.clamp_min(0.0).numpy()


def code_agreement(ref_codes: torch.Tensor, test_codes: torch.Tensor) -> np.ndarray:
    """``[T, K]`` int codes -> per-column fraction of equal codes ``[K]`` float64 (NaN when T = 0)."""
    if ref_codes.shape != test_codes.shape:
        raise ValueError(f"code shapes differ: {tuple(ref_codes.shape)} vs {tuple(test_codes.shape)}")
    if ref_codes.shape[0] == 0:
        return np.full(ref_codes.shape[1], math.nan)
    return (torch.as_tensor(ref_codes) == torch.as_tensor(test_codes)).double().mean(0).numpy()


def wave_snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    """``10 log10(sum ref^2 / sum (ref - test)^2)`` dB over equal-length float waves; ``inf`` if identical,
    NaN for empty waves."""
    ref = np.asarray(ref, dtype=np.float64).reshape(-1)
    test = np.asarray(test, dtype=np.float64).reshape(-1)
    if ref.shape != test.shape:
        raise ValueError(f"wave lengths differ: {ref.size} vs {test.size} samples")
    if ref.size == 0:
        return math.nan
    noise = float(np.sum((ref - test) ** 2))
    signal = float(np.sum(ref ** 2))
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
