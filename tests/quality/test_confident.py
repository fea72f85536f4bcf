"""Confident random checkpoints (``make_random_checkpoint(calibrated=True)``): decisions with a trained model's
margins, measured by the reference's own mean top-1 probability per codebook (docs/quality.md)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors import safe_open

from omnilab.checkpoint import random as ck
from _quality_common import GEN, TEXTS

FRAMES = dict(GEN, max_new_tokens=13)  # 12 frames per text, 24 pooled per codebook


@pytest.fixture(scope="module")
def confident(confident_tiny):
    return confident_tiny()


def test_calibrated_checkpoint_meets_the_stated_margin_per_codebook(confident, tiny_ckpt):
    from omnilab.pipeline import Pipeline
    from omnilab.quality import reference

    probs = {}
    for name, path in (("confident", confident), ("plain", tiny_ckpt())):
        pipe = Pipeline.from_pretrained(path, backend="eager", dtype="float32")
        try:
            probs[name] = reference(pipe, TEXTS, **FRAMES).top1_prob()  # [16]
        finally:
            pipe.close()
    assert probs["confident"].shape == (16,)
    # every codebook's mean top-1 probability is at least the target; plain random weights sit near 1/2048, so
    # the calibration (not the measurement) makes the margin
    assert np.all(probs["confident"] >= ck.CONFIDENT_TOP1_PROB), probs["confident"]
    assert np.all(probs["plain"] < 0.05), probs["plain"]


def test_calibration_changes_only_the_talker_file_and_stays_deterministic(confident, tiny_ckpt, tmp_path):
    plain = tiny_ckpt()
    again = ck.make_random_checkpoint(tmp_path / "again", "tiny", "custom_voice", 0, calibrated=True, progress=False)
    assert (again / "model.safetensors").read_bytes() == (confident / "model.safetensors").read_bytes()
    for f in ("config.json", "speech_tokenizer/model.safetensors"):
        assert (confident / f).read_bytes() == (plain / f).read_bytes(), f
    with safe_open(confident / "model.safetensors", "pt") as a, safe_open(plain / "model.safetensors", "pt") as b:
        changed = {k for k in a.keys() if not a.get_tensor(k).equal(b.get_tensor(k))}
    heads = {"talker.codec_head.weight", "talker.model.codec_embedding.weight"}
    assert heads <= changed
    assert {k for k in changed if ".lm_head." in k} == {f"talker.code_predictor.lm_head.{j}.weight" for j in range(15)}
    # tiny's writes and random head rows are already small: the rule gives it gain 1 everywhere, so no layer matrix
    # moves; nothing else (norms, text path, predictor embeddings) ever does
    assert set(ck.calibration_gains(_config("tiny")).values()) == {1.0}
    assert not any(".layers." in k for k in changed) and len(changed) == len(heads) + 15, sorted(changed)[:5]


def _config(size):
    from omnilab.checkpoint.configs import config_json
    from omnilab.config import Qwen3TTSConfig
    return Qwen3TTSConfig.from_dict(json.loads(config_json(size, "custom_voice", None)))


def test_the_gains_follow_the_geometry_by_the_stated_rule():
    cal = ck.CALIBRATION
    for size in ("mid", "0.6b", "1.7b"):
        cfg, g = _config(size), ck.calibration_gains(_config(size))
        assert all(0 < v <= 1 for v in g.values()), (size, g)
        for part, width in (("talker", cfg.talker.hidden_size), ("predictor", cfg.code_predictor.hidden_size)):
            # a random head row's logit spread, 0.02 sqrt(width), no wider than at bulk_width
            assert g[f"{part}_bulk"] == pytest.approx(min(1.0, (cal.bulk_width / width) ** 0.5)), (size, part)
    six, big = ck.calibration_gains(_config("0.6b")), ck.calibration_gains(_config("1.7b"))
    # 28 layers of 1024-wide writes: the talker's damped to a few percent, the 1.7B's (2048 wide) further
    assert six["talker_layers"] < 0.1 and six["predictor_layers"] < 0.1 and big["talker_layers"] < six["talker_layers"]
    assert six["talker_bulk"] == six["predictor_bulk"] == big["predictor_bulk"] == 1.0 and big["talker_bulk"] < 1
    # a damped stack's estimated writes land on write_ratio times the fed embedding (0.6B talker: 28 layers, C(c0)
    # 4 x 0.02); tiny's largest estimate, its predictor's (2 layers, E_j 0.02), is below it, so tiny is left as is
    writes = math.sqrt(28) * ck._write_rms(1024, 16 * 128, 3072) * six["talker_layers"]
    assert writes / (cal.c0_embedding_gain * 0.02) == pytest.approx(cal.write_ratio)
    assert 1.5 < math.sqrt(2) * ck._write_rms(64, 4 * 16, 128) / 0.02 < cal.write_ratio
    fixed = ck.calibration_gains(_config("0.6b"), ck.Calibration(layer_gain=0.5))
    assert fixed["talker_layers"] == fixed["predictor_layers"] == 0.5


def test_a_layer_gain_moves_exactly_the_residual_writes(confident, tmp_path):
    damped = ck.make_random_checkpoint(tmp_path / "damped", "tiny", "custom_voice", 0,
                                       calibrated=ck.Calibration(layer_gain=0.5), progress=False)
    cfg = _config("tiny")
    writes = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    want = {f"talker.model.layers.{i}.{w}" for i in range(cfg.talker.num_hidden_layers) for w in writes}
    want |= {f"talker.code_predictor.model.layers.{i}.{w}" for i in range(cfg.code_predictor.num_hidden_layers)
             for w in writes}
    with safe_open(damped / "model.safetensors", "pt") as a, safe_open(confident / "model.safetensors", "pt") as b:
        changed = {k for k in a.keys() if not a.get_tensor(k).equal(b.get_tensor(k))}
        assert changed == want, sorted(changed ^ want)[:5]
        for k in want:  # halving a bf16 value is exact
            assert a.get_tensor(k).equal(b.get_tensor(k) * 0.5), k
