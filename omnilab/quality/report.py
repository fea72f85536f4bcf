"""``QualityReport``: what :func:`omnilab.quality.compare` returns (docs/quality.md#the-report).

Contract:
- ``report.rows`` is a pandas DataFrame with one row per text, in order: ``request``, ``text``, ``frames``
  (the reference's frame count, which every forced metric covers), ``c0_agreement``, ``c0_kl_mean``,
  ``c0_kl_max``, ``cp_agreement`` (mean over codebooks 1-15), ``cp_agreement_by_codebook`` (a list of 15),
  ``stop_agreement`` (True/False where the reference stopped on EOS, None where it hit ``max_new_tokens``),
  ``replay_agreement`` (the reference's own forced argmax vs the codes it generated, all 16 codebooks: 1.0 for
  an eager reference by construction), ``wave_snr_db``, ``finish_reason``.
- ``summary()`` -> ``{"c0_agreement", "c0_kl_mean", "cp_agreement", "wave_snr_db"}``: the arithmetic means over
  requests that have frames (NaN rows skipped; ``wave_snr_db`` is the mean of per-request dB values, so it is
  ``inf`` when any request decodes identically), plus ``requests``, ``frames`` and ``c0_agreement_ci95``: the
  95 % Wilson interval of the first-codebook agreement over all the frames pooled (each frame one trial). On
  random-weight checkpoints the top two logits are often near ties, so agreement is a rate of rare flips: 64
  frames cannot tell 0.91 from 0.97 (one flip is 1.6 points), 256 frames narrow it to about +-2 points.
- ``by_codebook()`` -> DataFrame ``[request x codebook 1..15]`` of the per-codebook agreement.
- ``seconds``: wall time of the three phases (``reference`` generation, ``forcing``, ``decode``) and ``total``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import pandas as pd

from omnilab.html_tables import html_table, key_value_table

__all__ = ["COLUMNS", "QualityReport", "wilson_interval"]

COLUMNS = ("request", "text", "frames", "c0_agreement", "c0_kl_mean", "c0_kl_max", "cp_agreement",
           "cp_agreement_by_codebook", "stop_agreement", "replay_agreement", "wave_snr_db", "finish_reason")
SUMMARY_KEYS = ("c0_agreement", "c0_kl_mean", "cp_agreement", "wave_snr_db")


def _mean(values) -> float:
    a = np.asarray(list(values), dtype=np.float64)
    a = a[~np.isnan(a)]
    return float(a.mean()) if a.size else math.nan


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a rate (``z`` = 1.96: 95 %); (nan, nan) for no trials. Unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0 or all successes."""
    if trials <= 0:
        return (math.nan, math.nan)
    p, n = successes / trials, trials
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    d = 1 + z * z / n
    return (max(0.0, (mid - half) / d), min(1.0, (mid + half) / d))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if math.isinf(v) and v > 0 else f"{v:.4g}")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(f"{x:.2f}" for x in v) + "]"
    return str(v)


@dataclass(frozen=True, eq=False)
class QualityReport:
    """Fidelity of ``test`` against ``ref`` on the same texts (see the module docstring)."""
    rows: pd.DataFrame
    ref: str                          # the reference pipeline, in words (backend, dtype, quantization)
    test: str                         # the test pipeline, likewise
    c0_scores: str                    # "processed" (what greedy argmaxes) or "raw" (fp32 logits)
    seconds: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        missing = [c for c in COLUMNS if c not in self.rows.columns]
        if missing:
            raise ValueError(f"QualityReport rows lack columns {missing}")

    def summary(self) -> dict[str, Any]:
        """Means over requests with frames (see the module docstring), ``requests`` and ``frames``."""
        have = self.rows[self.rows["frames"] > 0]
        out: dict[str, Any] = {k: _mean(have[k]) for k in SUMMARY_KEYS}
        out["requests"] = int(len(self.rows))
        out["frames"] = int(self.rows["frames"].sum())
        agree = float((have["c0_agreement"].fillna(0) * have["frames"]).sum())
        out["c0_agreement_ci95"] = wilson_interval(round(agree), int(have["frames"].sum()))
        return out

    def by_codebook(self) -> pd.DataFrame:
        """Per-codebook agreement ``[request x 1..15]``."""
        table = [list(v) for v in self.rows["cp_agreement_by_codebook"]]
        return pd.DataFrame(table, index=list(self.rows["request"]), columns=list(range(1, 16)))

    def to_pandas(self) -> pd.DataFrame:
        return self.rows.copy()

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        s = self.summary()
        lo, hi = s["c0_agreement_ci95"]
        return (f"QualityReport({s['requests']} requests, {s['frames']} frames: c0 agreement "
                f"{_fmt(s['c0_agreement'])} (95 % {lo:.3f}-{hi:.3f}), KL {_fmt(s['c0_kl_mean'])} nats, cp agreement {_fmt(s['cp_agreement'])}, "
                f"wave SNR {_fmt(s['wave_snr_db'])} dB; ref={self.ref}, test={self.test})")

    def _repr_html_(self) -> str:
        s = {k: _fmt(v) for k, v in self.summary().items()}
        head = {"reference": self.ref, "test": self.test, "codebook-0 scores": self.c0_scores, **s,
                **{f"{k} s": f"{v:.2f}" for k, v in self.seconds.items()}}
        cols = [c for c in COLUMNS if c != "cp_agreement_by_codebook"]
        body = html_table(cols, ([_fmt(r[c]) for c in cols] for _, r in self.rows.iterrows()))
        return f"<div><b>QualityReport</b>{key_value_table(head)}{body}</div>"
