"""The code2wav dtype (and fp32 conv path) choice reaching the stages: the in-process stage sets it on its decoder,
the worker process gets the client's choice (here from OMNILAB_CODE2WAV_DTYPE) and reports it, and decodes what the
in-process stage decodes."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from omnilab.checkpoint.load import load_model
from omnilab.errors import InputError
from omnilab.stages.code2wav.stage import Code2WavStage
from omnilab.stages.code2wav.worker import Code2WavWorker
from omnilab.tuning.code2wav_dtype import ENV, code2wav_dtype_choice

CPU = (sorted(os.sched_getaffinity(0))[-1],)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("custom_voice")


@pytest.fixture(scope="module")
def local_bf16(ckpt):
    """In-process bf16 decoding on as many threads as the worker: equal by construction (same weights rounded the
    same way, same kernels, shapes and thread count)."""
    choice = code2wav_dtype_choice(env="bfloat16")
    return Code2WavStage(load_model(ckpt, dtype="float32", load_encoders=False).code2wav, threads=len(CPU),
                         dtype=choice)


def _codes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2048, size=(n, 16))


def test_stage_sets_the_decoder_dtype(local_bf16, ckpt):
    assert local_bf16.decoder.compute_dtype == torch.bfloat16
    assert local_bf16.info()["code2wav_dtype"] == "bfloat16"
    plain = Code2WavStage(load_model(ckpt, dtype="float32", load_encoders=False).code2wav)
    assert plain.info()["code2wav_dtype"] == "float32"  # dtype=None leaves the decoder as given
    with pytest.raises(InputError, match="torch.float32, torch.bfloat16"):
        Code2WavStage(load_model(ckpt, dtype="float32", load_encoders=False).code2wav, dtype="fp16")


def test_worker_dtype_is_checked_before_it_starts(ckpt):
    with pytest.raises(InputError, match="'float32', 'bfloat16'"):
        Code2WavWorker(ckpt, cpus=CPU, threads=1, dtype="float16")


def test_worker_gets_the_choice_and_matches_in_process(ckpt, local_bf16, monkeypatch):
    monkeypatch.setenv(ENV, "bfloat16")  # dtype=None: resolved in the client for an fp32 pipeline; the env wins
    with Code2WavWorker(ckpt, cpus=CPU, threads=1) as w:
        assert w.dtype.dtype == "bfloat16" and w.dtype.source == "env"
        assert w.info()["code2wav_dtype"] == "bfloat16"
        codes, prefix = _codes(0, 12), _codes(1, 4)
        np.testing.assert_array_equal(w.decode(codes, prefix_codes=prefix),
                                      local_bf16.decode(codes, prefix_codes=prefix))
        s, ls = w.open_session("a"), local_bf16.open_session("a")
        try:
            for lo, hi in [(0, 1), (1, 3), (3, 8)]:
                np.testing.assert_array_equal(s.push(codes[lo:hi]), ls.push(codes[lo:hi]))
        finally:
            s.close()
            ls.close()


@pytest.mark.slow
def test_worker_runs_the_conv_path_of_the_environment(ckpt, monkeypatch):
    """OMNILAB_CODE2WAV_CONV reaches the worker's decoder (it inherits the client's environment) and info() says so;
    the in-process stage reports its own."""
    from omnilab.tuning.code2wav_conv import ENV as CONV_ENV
    monkeypatch.setenv(CONV_ENV, "taps")
    with Code2WavWorker(ckpt, cpus=CPU, threads=1) as w:
        assert w.info()["code2wav_conv"].startswith("per-tap GEMMs")
    monkeypatch.delenv(CONV_ENV)
    stage = Code2WavStage(load_model(ckpt, dtype="float32", load_encoders=False).code2wav)
    assert stage.info()["code2wav_conv"].startswith("oneDNN direct from 1000 samples")
