"""Public Pipeline API on the eager backend: generate, stream, step-wise, batching, errors."""
from __future__ import annotations

import numpy as np
import pytest

from omnilab.errors import InputError, UnsupportedError
from omnilab.models.code2wav_stream import ChunkSchedule
from omnilab.pipeline import Pipeline

GREEDY = dict(do_sample=False, subtalker_do_sample=False)
TEXT = "Hello from omnilab."


def _gen(pipe, text=TEXT, **kw):
    args = dict(speaker="vivian", language="english", max_new_tokens=12, **GREEDY)
    args.update(kw)
    return pipe.generate(text, **args)


def test_generate_shapes_and_metadata(tiny_pipe):
    r = _gen(tiny_pipe)
    assert r.codes.shape == (11, 16) and r.codes.dtype == np.int64  # HF counting: max_new_tokens - 1 frames
    assert r.audio.dtype == np.float32 and r.audio.shape == (11 * 1920,)
    assert r.sample_rate == 24000 and r.finish_reason == "length"
    assert 0 <= r.codes.min() and r.codes.max() < 2048
    rms = float(np.sqrt(np.mean(r.audio ** 2)))
    assert 0.01 < rms < 0.5, rms
    df = r.timings_frame()
    assert {"talker_forward", "code_predictor", "code2wav_chunk"} <= set(df["name"])
    assert (df["duration_ms"] >= 0).all()
    assert r.rtf > 0 and abs(r.rtf * r.x_realtime - 1) < 1e-9
    assert "SynthesisResult" in repr(r) and "<table>" in r._repr_html_()


def test_greedy_is_deterministic_and_seeds_reproduce(tiny_pipe):
    a, b = _gen(tiny_pipe), _gen(tiny_pipe)
    np.testing.assert_array_equal(a.codes, b.codes)
    s1 = _gen(tiny_pipe, do_sample=True, subtalker_do_sample=True, seed=7)
    s2 = _gen(tiny_pipe, do_sample=True, subtalker_do_sample=True, seed=7)
    s3 = _gen(tiny_pipe, do_sample=True, subtalker_do_sample=True, seed=8)
    np.testing.assert_array_equal(s1.codes, s2.codes)
    assert s1.seed == 7 and not np.array_equal(s1.codes, s3.codes)


def test_input_ids_equal_text(tiny_pipe):
    ids = tiny_pipe.model.tokenizer.chat_wrap_ids(TEXT)
    a = _gen(tiny_pipe)
    b = tiny_pipe.generate(input_ids=ids, speaker="vivian", language="english", max_new_tokens=12, **GREEDY)
    np.testing.assert_array_equal(a.codes, b.codes)


def test_batch_equals_single(tiny_pipe):
    texts = [TEXT, "A second, somewhat longer sentence for the batch."]
    batch = tiny_pipe.generate(texts, speaker=["vivian", "ryan"], language="english", max_new_tokens=10, **GREEDY)
    assert len(batch) == 2
    for text, spk, res in zip(texts, ["vivian", "ryan"], batch):
        alone = _gen(tiny_pipe, text, speaker=spk, max_new_tokens=10)
        np.testing.assert_array_equal(res.codes, alone.codes)


@pytest.mark.parametrize("schedule", [ChunkSchedule(1, (), 25), ChunkSchedule(1, (2, 4), 5), ChunkSchedule(0, (), 3)])
def test_stream_equals_generate(tiny_pipe, schedule):
    full = _gen(tiny_pipe, max_new_tokens=20)
    chunks = list(tiny_pipe.stream(TEXT, speaker="vivian", language="english", max_new_tokens=20,
                                   chunk_schedule=schedule, **GREEDY))
    assert [c.num_frames for c in chunks] == schedule.sizes(full.num_frames)
    assert chunks[-1].is_last and not any(c.is_last for c in chunks[:-1])
    np.testing.assert_array_equal(np.concatenate([c.codes for c in chunks]), full.codes)
    np.testing.assert_allclose(np.concatenate([c.audio for c in chunks]), full.audio, atol=1e-4, rtol=0)
    ready = [c.t_ready_s for c in chunks]
    assert ready == sorted(ready)


def test_stream_cancel_frees_state(tiny_pipe):
    it = tiny_pipe.stream(TEXT, speaker="vivian", max_new_tokens=50, **GREEDY)
    first = next(it)
    assert first.num_frames == 1
    assert tiny_pipe.talker.num_live == 1 and tiny_pipe.code2wav.num_sessions == 1
    it.close()
    assert tiny_pipe.talker.num_live == 0 and tiny_pipe.code2wav.num_sessions == 0
    again = _gen(tiny_pipe)  # the pipeline stays usable and gives the same output
    np.testing.assert_array_equal(again.codes, _gen(tiny_pipe).codes)


def test_stepwise_matches_generate(tiny_pipe):
    full = _gen(tiny_pipe, max_new_tokens=8)
    rid = tiny_pipe.talker.start(TEXT, speaker="vivian", language="english", max_new_tokens=8, **GREEDY)
    frames, hidden = [], []
    while tiny_pipe.talker.has_unfinished():
        out = tiny_pipe.talker.step(return_hidden=True)[rid]
        assert out.talker_ms >= 0 and out.predictor_ms > 0
        if out.codes is not None:
            frames.append(out.codes.numpy())
            hidden.append(out.hidden)
    np.testing.assert_array_equal(np.stack(frames), full.codes)
    assert hidden[0].shape == (tiny_pipe.model.config.talker.hidden_size,)
    # decode by hand, chunk by chunk, through a code2wav session
    sess = tiny_pipe.code2wav.open_session("by-hand")
    audio = np.concatenate([sess.push(np.stack(frames)[i:i + 3]) for i in range(0, len(frames), 3)])
    sess.close()
    np.testing.assert_allclose(audio, full.audio, atol=1e-4, rtol=0)


def test_generate_refuses_while_stepwise_requests_live(tiny_pipe):
    rid = tiny_pipe.talker.start(TEXT, speaker="vivian", max_new_tokens=5)
    with pytest.raises(InputError, match="step-wise"):
        tiny_pipe.generate(TEXT, speaker="vivian")
    tiny_pipe.talker.abort(rid)
    assert tiny_pipe.talker.num_live == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(text=""), "empty"),
    (dict(text="   \n"), "empty"),
    (dict(text=None), "text is required"),
    (dict(speaker="nobody"), "vivian"),
    (dict(speaker=None), "speaker is required"),
    (dict(language="klingon"), "english"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=10**6), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(seed=-1), "seed"),
    (dict(ref_audio="x.wav"), "only accepted by the base"),
    (dict(input_ids=[1, 2, 3]), "input_ids"),
    (dict(bogus=1), "unknown argument"),
])
def test_bad_input_names_the_field(tiny_pipe, kwargs, match):
    args = dict(text=TEXT, speaker="vivian", language="english", max_new_tokens=5)
    args.update(kwargs)
    if "input_ids" in kwargs:
        args.pop("text")
    text = args.pop("text", None)
    with pytest.raises(InputError, match=match):
        tiny_pipe.generate(text, **args)
    assert tiny_pipe.talker.num_live == 0


def test_instruct_on_small_custom_voice_warns(tiny_pipe):
    with pytest.warns(UserWarning, match="instruct"):
        r = _gen(tiny_pipe, instruct="Speak slowly.", max_new_tokens=3)
    np.testing.assert_array_equal(r.codes, _gen(tiny_pipe, max_new_tokens=3).codes)


def test_deployment_names_the_decode_linear_kernel(tiny_pipe):
    from omnilab.kernels import gemv_choice

    dep = tiny_pipe.deployment
    assert dep.gemv == gemv_choice()
    rows = dict(dep.rows())
    assert rows["decode linears"].startswith(dep.gemv.label) and dep.gemv.reason in rows["decode linears"]


def test_deployment_shows_the_one_list_of_kernel_choices(tiny_pipe):
    """pipe.deployment and ``python -m omnilab.kernels`` print the rows of one function, ``kernel_choices``."""
    from omnilab.kernels import kernel_choices

    dep = tiny_pipe.deployment
    want = kernel_choices(tiny_pipe.model.dtype)
    assert [(k.key, k.title) for k in dep.kernels] == [(k.key, k.title) for k in want]
    rows = dict(dep.rows())
    for k in want:
        assert rows[k.title] == f"{k.choice.label}: {k.choice.reason}"
    assert {k.key: k.choice for k in dep.kernels}["snake"] is dep.snake


def test_bad_gemv_mode_fails_at_load(tiny_ckpt, monkeypatch):
    from omnilab.kernels import gemv

    monkeypatch.setenv(gemv.ENV, "fast")
    gemv.reset()
    try:
        with pytest.raises(ValueError, match="OMNILAB_CPU_GEMV='fast' is not a GEMV mode; accepted: auto"):
            Pipeline.from_pretrained(tiny_ckpt(), backend="eager", dtype="float32")
    finally:
        monkeypatch.delenv(gemv.ENV)
        gemv.reset()


def test_from_pretrained_parses_each_config_file_once(tiny_ckpt, monkeypatch):
    """config.json and speech_tokenizer/config.json are parsed once per load: the deploy profile's geometry
    and the loader share them (they were parsed twice each, once for planning and once for loading)."""
    from omnilab.config import Qwen3TTSConfig, SpeechTokenizerConfig

    path = tiny_ckpt()  # built (and its configs written) before counting
    parsed: list[str] = []
    for cls in (Qwen3TTSConfig, SpeechTokenizerConfig):
        real = cls.from_dict.__func__
        monkeypatch.setattr(cls, "from_dict", classmethod(
            lambda c, d, _real=real: parsed.append(c.__name__) or _real(c, d)))
    import pathlib
    reads: list[str] = []
    real_read = pathlib.Path.read_text
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: (
        reads.append(str(self)) if self.name == "config.json" else None) or real_read(self, *a, **k))
    with Pipeline.from_pretrained(path, backend="eager", dtype="float32", deploy_profile="auto") as pipe:
        assert pipe.profile is not None and pipe.model.config.tts_model_type == "custom_voice"
    assert sorted(parsed) == ["Qwen3TTSConfig", "SpeechTokenizerConfig"], parsed
    # ... and not read again as raw JSON (the tokenizer takes transformers_version from the parsed config)
    assert sum(r == str(path / "config.json") for r in reads) <= 1, reads


def test_device_and_backend_errors(tiny_ckpt):
    with pytest.raises(UnsupportedError, match="'cpu'"):
        Pipeline.from_pretrained(tiny_ckpt(), device="cuda")
    with pytest.raises(InputError, match="eager"):
        Pipeline.from_pretrained(tiny_ckpt(), backend="tensorrt")


def test_closed_pipeline_refuses_work(tiny_ckpt):
    with Pipeline.from_pretrained(tiny_ckpt(), backend="eager", dtype="float32") as pipe:
        pass
    with pytest.raises(InputError, match="closed"):
        pipe.generate(TEXT, speaker="vivian")


def _tone(sr: int, seconds: float = 1.5) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    rng = np.random.default_rng(0)
    return (0.3 * np.sin(2 * np.pi * 180 * t) + 0.1 * np.sin(2 * np.pi * 360 * t)
            + 0.02 * rng.standard_normal(t.shape)).astype(np.float32)


def test_voice_design_and_base_variants(tiny_ckpt, tmp_path):
    with Pipeline.from_pretrained(tiny_ckpt("voice_design"), backend="eager", dtype="float32") as vd:
        a = vd.generate(TEXT, instruct="A calm, low voice.", max_new_tokens=6, **GREEDY)
        b = vd.generate(TEXT, instruct="A bright, fast voice.", max_new_tokens=6, **GREEDY)
        assert a.codes.shape == (5, 16) and not np.array_equal(a.codes, b.codes)
        with pytest.raises(InputError, match="no built-in speakers"):
            vd.generate(TEXT, speaker="vivian")
    with Pipeline.from_pretrained(tiny_ckpt("base"), backend="eager", dtype="float32") as base:
        with pytest.raises(InputError, match="ref_audio is required"):
            base.generate(TEXT)
        with pytest.raises(InputError, match="ref_text"):
            base.generate(TEXT, ref_audio=(_tone(24000), 24000), x_vector_only_mode=False)
        with pytest.raises(InputError, match="sample rate"):
            base.generate(TEXT, ref_audio=_tone(24000))
        xv = base.generate(TEXT, ref_audio=(_tone(24000), 24000), max_new_tokens=6, **GREEDY)
        icl = base.generate(TEXT, ref_audio=(_tone(24000), 24000), ref_text="A short reference.",
                            max_new_tokens=6, **GREEDY)
        assert xv.codes.shape == icl.codes.shape == (5, 16)
        assert icl.audio.shape == (5 * 1920,)  # the reference frames' audio is cut off
        # a 16 kHz file is resampled to 24 kHz
        import soundfile as sf
        sf.write(tmp_path / "ref16k.wav", _tone(16000), 16000)
        r16 = base.generate(TEXT, ref_audio=str(tmp_path / "ref16k.wav"), max_new_tokens=4, **GREEDY)
        assert r16.codes.shape == (3, 16)


def test_save_wav_roundtrip(tiny_pipe, tmp_path):
    import soundfile as sf

    r = _gen(tiny_pipe, max_new_tokens=4)
    wav, sr = sf.read(str(r.save_wav(tmp_path / "a.wav")), dtype="float32")
    assert sr == 24000
    np.testing.assert_allclose(wav, r.audio, atol=1e-7)
