"""The fidelity formulas (omnilab/quality/metrics.py) on inputs whose answers are known in closed form."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from omnilab.quality import metrics

INF = math.inf


def test_top1_agreement_counts_equal_argmaxes():
    ref = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]])
    test = torch.tensor([[0.0, 2.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 1.0], [9.0, 0.0, 0.0]])
    assert metrics.top1_agreement(ref, test) == 0.75
    assert math.isnan(metrics.top1_agreement(ref[:0], test[:0]))
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.top1_agreement(ref, test[:, :2])


def test_kl_matches_the_closed_form_and_is_zero_for_equal_rows():
    # p = softmax([0, log 3]) = (1/4, 3/4), q = (1/2, 1/2): KL = 1/4 log(1/2) + 3/4 log(3/2), exactly in float64
    ref = torch.tensor([[0.0, math.log(3.0)], [1.5, -2.0]], dtype=torch.float32)
    test = torch.tensor([[0.0, 0.0], [1.5, -2.0]], dtype=torch.float32)
    kl = metrics.kl_per_frame(ref, test)
    want = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    # float32 inputs: log(3) is rounded to float32 (relative error < 6e-8), so the closed form holds to ~1e-7
    assert kl[0] == pytest.approx(want, rel=1e-6)
    assert kl[1] == 0.0  # equal rows: every log-ratio is exactly 0
    assert (kl >= 0).all()


def test_kl_ignores_ids_both_sides_suppress_and_is_inf_where_only_test_does():
    ref = torch.tensor([[0.0, 1.0, -INF]])
    same_mask = torch.tensor([[0.0, 1.0, -INF]])
    assert metrics.kl_per_frame(ref, same_mask)[0] == 0.0  # no NaN from -inf - -inf
    test_only = torch.tensor([[0.0, -INF, 5.0]])
    assert metrics.kl_per_frame(ref, test_only)[0] == INF  # the reference may emit id 1, the test never


def test_code_agreement_is_per_codebook():
    ref = torch.tensor([[1, 2, 3], [4, 5, 6]])
    test = torch.tensor([[1, 0, 3], [4, 5, 0]])
    np.testing.assert_array_equal(metrics.code_agreement(ref, test), [1.0, 0.5, 0.5])
    assert np.isnan(metrics.code_agreement(ref[:0], test[:0])).all()


def test_wave_snr_formula_identity_and_edges():
    ref = np.array([1.0, 1.0], dtype=np.float32)
    assert metrics.wave_snr_db(ref, np.array([1.0, 0.0])) == pytest.approx(10 * math.log10(2.0), abs=1e-12)
    assert metrics.wave_snr_db(ref, ref.copy()) == INF
    assert metrics.wave_snr_db(np.zeros(3), np.ones(3)) == -INF
    assert math.isnan(metrics.wave_snr_db(np.zeros(0), np.zeros(0)))
    with pytest.raises(ValueError, match="lengths differ"):
        metrics.wave_snr_db(ref, np.zeros(3))
