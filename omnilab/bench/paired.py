"""Ratios between configurations taken round by round (``--interleave``), then the median over rounds.

A shared 2-core host drifts: in one run the same configuration took 21 ms per step in one round and 29 in
another, while the configurations of one round (seconds apart) moved together. A ratio of two medians carries
that drift; the median of per-round ratios cancels most of it, because both configurations of a pair ran in the
same round. Two figures per row:

- ``step_ratio`` (``ttfa_ratio``): this row / the first configuration, paired per round;
- ``step_vs_auto`` (``ttfa_vs_auto``): this row / its ``+auto`` sibling (the same name with the dtype suffix
  replaced by ``+auto``), paired per round: "does ``dtype="auto"`` pick the fastest path" reads straight off
  the column (auto is within 5 % of a sibling when the sibling's figure is >= 1 / 1.05 = 0.952).

Plain Python over the per-round figures (``backends.derive`` dicts), so the logic is tested without a model.
"""
from __future__ import annotations

import math
import statistics
from typing import Mapping, Sequence

from omnilab.bench.backends import DTYPE_SUFFIXES

DTYPE_TOKENS = tuple(s.lstrip("+") for s in DTYPE_SUFFIXES)  # the configuration suffixes that set the dtype
KEYS = {"step_ms": ("step_ratio", "step_vs_auto"), "ttfa_ms": ("ttfa_ratio", "ttfa_vs_auto")}


def auto_sibling(name: str) -> str | None:
    """``"vllm+int4+bf16"`` -> ``"vllm+int4+auto"``; None when the name has no dtype suffix or is the auto one."""
    parts = name.split("+")
    idx = [i for i, p in enumerate(parts) if p in DTYPE_TOKENS]
    if len(idx) != 1 or parts[idx[0]] == "auto":
        return None
    parts[idx[0]] = "auto"
    return "+".join(parts)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def paired(a: Sequence[Mapping], b: Sequence[Mapping], key: str) -> tuple[float, list[float]] | None:
    """Median over rounds of ``a[r][key] / b[r][key]`` and the per-round ratios (rounds where both have it)."""
    ratios = [x[key] / y[key] for x, y in zip(a, b) if _num(x.get(key)) and _num(y.get(key))]
    return (statistics.median(ratios), ratios) if ratios else None


def paired_figures(runs: Mapping[str, Sequence[Mapping]]) -> dict[str, dict[str, float | list[float]]]:
    """Per configuration (``runs``: name -> its per-round dicts, in round order; the first name is the base):
    ``step_ratio``, ``ttfa_ratio`` and, where an ``+auto`` sibling ran, ``step_vs_auto``, ``ttfa_vs_auto``, each
    with ``<key>_range`` = [min, max] of the per-round ratios. Empty for one round (no pairs worth the name)."""
    names = list(runs)
    if not names or min(len(v) for v in runs.values()) < 2:
        return {}
    out: dict[str, dict] = {n: {} for n in names}
    for n in names:
        for key, (vs_first, vs_auto) in KEYS.items():
            for label, other in ((vs_first, names[0]), (vs_auto, auto_sibling(n))):
                if other not in runs:
                    continue
                got = paired(runs[n], runs[other], key)
                if got:
                    out[n][label], out[n][f"{label}_range"] = got[0], [min(got[1]), max(got[1])]
    return out
