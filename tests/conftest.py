"""Shared fixtures: tiny random checkpoints (one per variant, built once per session)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """``tiny_ckpt(variant="custom_voice", seed=0) -> Path`` of a tiny random checkpoint (cached per session)."""
    from omnilab.checkpoint.random import make_random_checkpoint

    made = {}

    def get(variant: str = "custom_voice", seed: int = 0):
        key = (variant, seed)
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{variant}-{seed}")
            made[key] = make_random_checkpoint(path, size="tiny", variant=variant, seed=seed, overwrite=True)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_pipe(tiny_ckpt):
    """An eager fp32 pipeline on the tiny CustomVoice checkpoint."""
    from omnilab.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32")
    yield pipe
    pipe.close()
