"""``bench.paired``: ratios taken within a round, then the median, so a drift shared by a round's rows cancels."""
from __future__ import annotations

import pytest

from omnilab.bench import backends as be
from omnilab.bench.paired import DTYPE_TOKENS, auto_sibling, paired, paired_figures


def test_auto_sibling_replaces_the_dtype_suffix_only():
    assert auto_sibling("vllm+int4+bf16") == "vllm+int4+auto"
    assert auto_sibling("eager+fp32+torch-gemv") == "eager+auto+torch-gemv"
    assert auto_sibling("eager+int4+auto") is None and auto_sibling("eager+int4") is None
    assert set(DTYPE_TOKENS) == {s.lstrip("+") for s in be.DTYPE_SUFFIXES}  # one copy of the suffixes
    for name in ("vllm+int4+bf16", "eager+fp32+torch-gemv"):  # the sibling is a configuration the bench accepts
        assert be.parse_config(auto_sibling(name)).dtype == "auto"


def test_a_drift_shared_by_a_round_cancels_in_the_paired_ratio():
    """The host slows by 40 % in round 2 for both rows and in round 3 for b's turn only; b is 4 % slower than a.
    The ratio of the medians says 36.4 / 25 = 1.46 (b's median lands in a slow turn); the paired median 1.04."""
    drift = [1.0, 1.4, 1.0]
    a = [{"step_ms": 25.0 * d, "ttfa_ms": 150.0 * d} for d in drift]
    b = [{"step_ms": 26.0 * d, "ttfa_ms": 150.0 * d} for d in (1.0, 1.4, 1.4)]
    med, ratios = paired(b, a, "step_ms")
    assert med == pytest.approx(1.04) and len(ratios) == 3
    assert sorted(x["step_ms"] for x in b)[1] / sorted(x["step_ms"] for x in a)[1] == pytest.approx(1.456)
    assert paired(b, [{"step_ms": None}] * 3, "step_ms") is None  # no figure to pair: no ratio, not a zero


def test_paired_figures_name_the_first_row_and_the_auto_sibling():
    rounds = {  # per-round step and TTFA of four configurations; rounds 2 and 3 drift
        "eager+int4+auto": [{"step_ms": 27.0, "ttfa_ms": 140.0}, {"step_ms": 22.0, "ttfa_ms": 150.0},
                            {"step_ms": 30.0, "ttfa_ms": 160.0}],
        "eager+int4+bf16": [{"step_ms": 28.0, "ttfa_ms": 154.0}, {"step_ms": 23.0, "ttfa_ms": 150.0},
                            {"step_ms": 29.0, "ttfa_ms": 168.0}],
        "vllm+int4+auto": [{"step_ms": 30.0, "ttfa_ms": 150.0}, {"step_ms": 25.0, "ttfa_ms": 160.0},
                           {"step_ms": 33.0, "ttfa_ms": 170.0}],
        "vllm+int4": [{"step_ms": 31.0, "ttfa_ms": 150.0}, {"step_ms": 26.0, "ttfa_ms": 160.0},
                      {"step_ms": 33.0, "ttfa_ms": 170.0}],
    }
    got = paired_figures(rounds)
    assert got["eager+int4+auto"]["step_ratio"] == 1.0 and "step_vs_auto" not in got["eager+int4+auto"]
    bf16 = got["eager+int4+bf16"]
    assert bf16["step_vs_auto"] == pytest.approx(28 / 27) and bf16["step_vs_auto_range"] == [29 / 30, 23 / 22]
    assert bf16["ttfa_vs_auto"] == pytest.approx(1.05)
    assert got["vllm+int4+auto"]["step_ratio"] == pytest.approx(30 / 27)  # vs the first row, paired
    assert "step_vs_auto" not in got["vllm+int4"]  # no dtype suffix: nothing to call its auto sibling
    assert paired_figures({k: v[:1] for k, v in rounds.items()}) == {}  # one round: no pairs worth the name
