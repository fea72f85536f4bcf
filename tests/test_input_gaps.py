"""Input validation (docs/reliability.md#input-validation), each on the path a user takes (eager backend): the
error class and a message naming the value and the accepted ones, before anything reaches an engine."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omnilab.audio import to_mono
from omnilab.errors import ConfigError, InputError
from omnilab.pipeline import Pipeline
from omnilab.requests import UserRequest, build_request

GREEDY = dict(do_sample=False, subtalker_do_sample=False, max_new_tokens=4)
TEXT = "Hello from omnilab."


def _speech(n: int = 24000, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


@pytest.fixture(scope="module")
def base_pipe(tiny_ckpt):
    with Pipeline.from_pretrained(tiny_ckpt("base"), backend="eager", dtype="float32") as pipe:
        yield pipe


@pytest.fixture(scope="module")
def design_pipe(tiny_ckpt):
    with Pipeline.from_pretrained(tiny_ckpt("voice_design"), backend="eager", dtype="float32") as pipe:
        yield pipe


@pytest.mark.parametrize("instruct", [None, "", "   \n"])
def test_voice_design_requires_an_instruct(design_pipe, instruct):
    with pytest.raises(InputError, match=r"instruct is required for the voice_design model .*got "):
        design_pipe.generate(TEXT, instruct=instruct, **GREEDY)
    assert design_pipe.generate(TEXT, instruct="A calm voice.", **GREEDY).codes.shape == (3, 16)


@pytest.mark.parametrize("value", ["no", "False", 0, 1, "yes"])
def test_x_vector_only_mode_takes_bools_only(base_pipe, value):
    with pytest.raises(InputError, match=r"x_vector_only_mode must be True, False or None .*got " + repr(value)):
        base_pipe.generate(TEXT, ref_audio=(_speech(), 24000), ref_text="Some words.", x_vector_only_mode=value,
                           **GREEDY)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_ref_audio_is_refused_before_the_engine(base_pipe, bad):
    wav = _speech()
    wav[100:200] = bad
    with pytest.raises(InputError, match=r"ref_audio: audio has 100 non-finite samples \(NaN or inf\) of 24000"):
        base_pipe.generate(TEXT, ref_audio=(wav, 24000), **GREEDY)
    with pytest.raises(InputError, match="non-finite"):
        base_pipe.generate(TEXT, ref_audio=(np.full(24000, bad, np.float32), 24000), **GREEDY)
    # finite samples whose speaker embedding overflows never reach an engine either
    with pytest.raises(InputError, match="non-finite speaker embedding"):
        build_request(base_pipe.model, UserRequest(text=TEXT, ref_audio=(np.full(24000, 3e38, np.float32), 24000)))
    assert base_pipe.talker.num_live == 0


def test_stereo_layouts_are_mixed_down(base_pipe):
    left, right = _speech(seed=1), _speech(seed=2)
    mono = (np.stack([left, right]).astype(np.float32).mean(axis=0))
    np.testing.assert_array_equal(to_mono(np.stack([left, right])), mono)      # [2, N]: torchaudio's layout
    np.testing.assert_array_equal(to_mono(np.stack([left, right], 1)), mono)   # [N, 2]: soundfile's layout
    x = [build_request(base_pipe.model, UserRequest(text=TEXT, ref_audio=(a, 24000)))[0].x_vector
         for a in (mono, np.stack([left, right]), torch.from_numpy(np.stack([left, right], 1)))]
    assert torch.equal(x[0], x[1]) and torch.equal(x[0], x[2])
    for shape in ((3, 4000, 2), (4000, 4000), (20, 24000), (5, 5)):
        with pytest.raises(InputError, match=r"ref_audio: audio must be \[samples\], \[samples, channels\] or "
                                             r"\[channels, samples\] with at most 8 channels"):
            base_pipe.generate(TEXT, ref_audio=(np.zeros(shape, np.float32), 24000), **GREEDY)


@pytest.mark.parametrize("sr", [float("nan"), "24k", -24000, 0, 22050.5, None, True])
def test_bad_ref_audio_sample_rate_names_the_accepted_values(base_pipe, sr):
    with pytest.raises(InputError, match=r"ref_audio: .*(positive integer number of Hz; got|needs its sample rate)"):
        base_pipe.generate(TEXT, ref_audio=(_speech(), sr), **GREEDY)


@pytest.mark.parametrize("codes, match", [
    ("abc", r"codes must be an integer array \[frames, 16\] \(numpy, torch or nested lists\); got 'abc'"),
    (None, r"codes must be an integer array \[frames, 16\] .*got None"),
    ([[1, 2], [3]], r"codes must be an integer array"),
    (np.zeros((3, 16), np.float32), r"got shape \(3, 16\) dtype float32"),
    (np.zeros((3, 8), np.int64), r"got shape \(3, 8\) dtype int64"),
    (np.zeros((2, 16), bool), r"dtype bool"),
    (np.full((2, 16), 2048), r"codes must be < codebook_size 2048 .*got max 2048"),
])
def test_decode_refuses_what_is_not_codes(tiny_pipe, codes, match):
    with pytest.raises(InputError, match=match):
        tiny_pipe.code2wav.decode(codes)
    s = tiny_pipe.code2wav.open_session("gap-test")
    try:
        with pytest.raises(InputError, match=match):
            s.push(codes)
    finally:
        s.close()
    with pytest.raises(InputError, match="prefix_codes must be"):
        tiny_pipe.code2wav.decode(np.zeros((2, 16), np.int64), prefix_codes="abc")


def test_negative_codes_are_padding(tiny_pipe):
    pad = tiny_pipe.code2wav.decode(np.full((2, 16), -1))
    np.testing.assert_array_equal(pad, tiny_pipe.code2wav.decode(np.zeros((2, 16), np.int64)))


def test_a_closed_pipeline_answers_with_an_error(tiny_ckpt):
    pipe = Pipeline.from_pretrained(tiny_ckpt("custom_voice"), backend="eager", dtype="float32")
    pipe.close()
    with pytest.raises(InputError, match="closed"):
        pipe.code2wav.decode(np.zeros((2, 16), np.int64))
    with pytest.raises(InputError, match="closed"):
        pipe.talker.step()
    with pytest.raises(InputError, match="closed"):
        pipe.generate(TEXT, speaker="vivian", **GREEDY)


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "1e300", "lots"])
def test_kv_cache_gib_must_be_positive_and_finite(value):
    from omnilab.profiles.overrides import Overrides
    with pytest.raises(ConfigError, match=rf"OMNILAB_KV_CACHE_GIB='{value}': expected a positive, finite number"):
        Overrides({"OMNILAB_KV_CACHE_GIB": value}).get("kv_cache_bytes")
    assert Overrides({"OMNILAB_KV_CACHE_GIB": "0.5"}).get("kv_cache_bytes")[0] == 1 << 29
