"""Confident random checkpoints (``make_random_checkpoint(calibrated=True)``): decisions with a trained model's
margins, measured by the reference's own mean top-1 probability per codebook (docs/quality.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

from omnilab.checkpoint import random as ck
from _quality_common import GEN, TEXTS

FRAMES = dict(GEN, max_new_tokens=13)  # 12 frames per text, 24 pooled per codebook


@pytest.fixture(scope="module")
def confident(tmp_path_factory):
    return ck.make_random_checkpoint(tmp_path_factory.mktemp("confident") / "ck", "tiny", "custom_voice", 0,
                                     calibrated=True, progress=False)


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
    n_layers = json.loads((plain / "config.json").read_text())["talker_config"]["num_hidden_layers"]
    heads = {"talker.codec_head.weight", "talker.model.codec_embedding.weight"}
    assert heads <= changed
    assert {k for k in changed if ".lm_head." in k} == {f"talker.code_predictor.lm_head.{j}.weight" for j in range(15)}
    # with layer_gain 1 no layer matrix moves; nothing else (norms, text path, predictor embeddings) ever does
    assert ck.CALIBRATION.layer_gain == 1.0 and not any(".layers." in k for k in changed), sorted(changed)[:5]
    assert len(changed) == len(heads) + 15, n_layers
