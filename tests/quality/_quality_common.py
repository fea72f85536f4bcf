"""Constants and fixtures shared by the fidelity tests, imported by name by each test module (not a ``conftest``:
a second ``conftest`` module would shadow the top-level one, whose helpers other tests import as ``conftest``)."""
from __future__ import annotations

import pytest
import torch

TEXTS = ["Hello world, this is a test.", "Second one here."]
GEN = dict(speaker="vivian", language="english", max_new_tokens=8)  # 7 frames per text (length-limited)


@pytest.fixture(scope="session")
def load_pipe(tiny_ckpt):
    """``load_pipe(variant="custom_voice", **from_pretrained kwargs)``: a fresh eager pipeline (closed at the end)."""
    from omnilab.pipeline import Pipeline

    made = []

    def get(variant: str = "custom_voice", **kw):
        kw = {"backend": "eager", "dtype": "float32", **kw}
        pipe = Pipeline.from_pretrained(tiny_ckpt(variant), **kw)
        made.append(pipe)
        return pipe

    yield get
    for p in made:
        p.close()


@pytest.fixture(scope="session")
def eos_pipe(load_pipe):
    """A second fp32 load whose talker adds 1e4 to the EOS logit: running free and greedy it stops as soon as
    ``min_new_tokens`` (2) lets it, after 2 frames, where the tiny model runs to ``max_new_tokens``. Everything
    else (weights, code predictor, code2wav) is the tiny checkpoint's, loaded as ``tiny_pipe`` loads it."""
    pipe = load_pipe()
    talker = pipe.model.talker
    eos = pipe.model.config.talker.codec_eos_token_id
    plain = talker.logits
    boost = torch.zeros(pipe.model.config.talker.vocab_size)
    boost[eos] = 1e4

    def logits(hidden):
        return plain(hidden) + boost.to(hidden.dtype)

    talker.logits = logits  # instance attribute: the engine and teacher forcing both call talker.logits
    return pipe
