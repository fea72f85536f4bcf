"""OMNILAB_CODE2WAV_CONV: the fp32 conv path code2wav runs, with a reason; a bad value names the accepted ones."""
from __future__ import annotations

import pytest

from omnilab.errors import ConfigError
from omnilab.tuning.code2wav_conv import ENV, MIN_SAMPLES, NEVER, conv_choice


def test_modes_and_thresholds(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    auto = conv_choice()
    assert (auto.mode, auto.min_samples, auto.source) == ("auto", MIN_SAMPLES, "auto")
    assert f">= {MIN_SAMPLES} samples" in auto.reason and ENV in auto.reason  # the rule and its override, said
    taps = conv_choice(env="taps")
    assert taps.min_samples == NEVER and taps.label.startswith("per-tap GEMMs") and taps.source == "env"
    assert conv_choice(env=" Direct ").min_samples == 0
    monkeypatch.setenv(ENV, "taps")
    assert conv_choice().mode == "taps" and ENV in conv_choice().reason


@pytest.mark.parametrize("bad", ["onednn", "1000", "gemm"])
def test_bad_value_names_the_accepted_ones(bad):
    with pytest.raises(ConfigError, match=f"{ENV}=.*accepted: auto, taps, direct"):
        conv_choice(env=bad)
