"""omnilab.audio: wav loading, resampling, and the speaker-encoder mel front end (vs. librosa/qwen-tts goldens)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from omnilab import audio
from omnilab.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "encoders" / "encoders_golden.safetensors"


def _golden_script():
    spec = importlib.util.spec_from_file_location("encoders_golden", ROOT / "scripts/reference/encoders_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def golden():
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(str(GOLDEN), "pt") as f:
        meta = f.metadata()
    return load_file(str(GOLDEN)), meta


def test_slaney_mel_scale_known_values():
    # linear below 1 kHz (200/3 Hz per mel), log above: 12 kHz -> 15 + 27 ln(12) / ln(6.4)
    assert audio._hz_to_mel_slaney(np.array([0.0, 500.0, 1000.0]))[1:].tolist() == pytest.approx([7.5, 15.0])
    assert float(audio._hz_to_mel_slaney(np.array(12000.0))) == pytest.approx(15 + 27 * np.log(12) / np.log(6.4))
    mels = np.linspace(0, 60, 13)
    assert np.allclose(audio._hz_to_mel_slaney(audio._mel_to_hz_slaney(mels)), mels, atol=1e-9)


def test_mel_filterbank_equals_librosa(golden):
    g, meta = golden
    fb = audio.mel_filterbank_slaney(24000, 1024, 128, 0.0, 12000.0)
    assert fb.dtype == np.float32 and list(fb.shape) == json.loads(meta["fb_shape"]) == [128, 513]
    rows, cols = np.nonzero(fb)
    assert np.array_equal(rows, g["mel.fb_rows"].numpy()) and np.array_equal(cols, g["mel.fb_cols"].numpy())
    np.testing.assert_allclose(fb[rows, cols], g["mel.fb_values"].numpy(), rtol=1e-6, atol=1e-9)
    assert not fb.flags.writeable  # cached and shared


def test_log_mel_matches_reference(golden):
    g, meta = golden
    gs = _golden_script()
    n = int(meta["mel_samples"])
    wav = gs.test_signal(n)
    assert float(np.float64(wav).sum()) == pytest.approx(json.loads(meta["signal_sums"])[str(n)], abs=1e-9)
    mel = audio.log_mel_spectrogram(wav)  # [1, frames, 128]
    assert mel.shape == (1, n // 256, 128)
    torch.testing.assert_close(mel[0], g["mel.out"], rtol=0, atol=1e-5)
    # batch rows are independent and numpy / tensor inputs agree
    batch = audio.log_mel_spectrogram(torch.from_numpy(np.stack([wav, wav[::-1].copy()])))
    torch.testing.assert_close(batch[0], mel[0])


def test_log_mel_rejects_short_audio():
    with pytest.raises(InputError, match="too short"):
        audio.log_mel_spectrogram(np.zeros(300, np.float32))


def _librosa_fix_length(y: np.ndarray, n: int) -> np.ndarray:
    """``librosa.util.fix_length(y, size=n)`` for 1-D: cut, or pad with zeros at the end."""
    return y[:n] if len(y) >= n else np.pad(y, (0, n - len(y)))


@pytest.mark.parametrize("orig_sr", [16000, 22050, 44100, 48000])
def test_resample_is_librosa_soxr_hq_bit_for_bit(orig_sr):
    """What qwen-tts calls: ``librosa.resample(y=wav.astype(np.float32), orig_sr=sr, target_sr=24000)``, i.e.
    soxr_hq fixed to librosa's length ``int(np.ceil(n * (24000 / sr)))`` (float ratio), float32."""
    import soxr

    rng = np.random.default_rng(orig_sr)
    for n in (1, 3, 100, 12345, orig_sr, int(0.9 * orig_sr)):
        x = (0.3 * rng.standard_normal(n)).astype(np.float32)
        want_len = int(np.ceil(n * (24000.0 / orig_sr)))
        want = _librosa_fix_length(soxr.resample(x, orig_sr, 24000, quality="soxr_hq"), want_len)
        got = audio.resample(x, orig_sr, 24000)
        assert got.dtype == np.float32 and got.shape == (want_len,), (n, got.shape, want_len)
        assert np.array_equal(got, want), f"{orig_sr} Hz, {n} samples"
        # float64 / torch / non-contiguous inputs are cast to contiguous float32 first, as the official .astype
        assert np.array_equal(audio.resample(x.astype(np.float64), orig_sr, 24000), want)
        assert np.array_equal(audio.resample(torch.from_numpy(x), orig_sr, 24000), want)
        assert np.array_equal(audio.resample(np.repeat(x, 2)[::2], orig_sr, 24000), want)


# Output lengths of librosa 0.11.0 ``librosa.resample(y, orig_sr=sr, target_sr=24000)`` (recorded in the reference
# env). librosa computes ceil(n * float ratio): 44100 samples at 44.1 kHz give 24001 (float rounding), one more
# than soxr returns; librosa pads that sample with a zero.
LIBROSA_LENGTHS = [  # (orig_sr, n_in, n_out)
    (16000, 1, 2), (16000, 14400, 21600), (22050, 1, 2), (22050, 44100, 48001), (22050, 12345, 13437),
    (44100, 100, 55), (44100, 44100, 24001), (44100, 39690, 21601), (44100, 12345, 6719),
    (48000, 2, 1), (48000, 12345, 6173), (24001, 44100, 44099), (8000, 3, 9),
]


@pytest.mark.parametrize("orig_sr,n_in,n_out", LIBROSA_LENGTHS)
def test_resample_length_is_librosas(orig_sr, n_in, n_out):
    x = np.random.default_rng(n_in).standard_normal(n_in).astype(np.float32)
    y = audio.resample(x, orig_sr, 24000)
    assert y.shape == (n_out,)


def test_resample_pads_librosas_extra_sample_with_zero():
    import soxr

    x = np.random.default_rng(0).standard_normal(44100).astype(np.float32)
    raw = soxr.resample(x, 44100, 24000, quality="soxr_hq")
    y = audio.resample(x, 44100, 24000)
    assert len(raw) == 24000 and len(y) == 24001 and y[-1] == 0.0 and np.array_equal(y[:-1], raw)


@pytest.mark.parametrize("orig_sr", [16000, 22050, 44100, 48000, 8000])
def test_resample_sine_to_24k(orig_sr):
    n = orig_sr // 2  # 0.5 s
    f = 997.0
    x = (0.5 * np.sin(2 * np.pi * f * np.arange(n) / orig_sr)).astype(np.float32)
    y = audio.resample(x, orig_sr, 24000)
    assert y.dtype == np.float32 and len(y) == int(np.ceil(n * (24000 / orig_sr)))  # 12001 for 22050 (float)
    ref = 0.5 * np.sin(2 * np.pi * f * np.arange(len(y)) / 24000)
    mid = slice(len(y) // 8, -len(y) // 8)  # away from the edges
    assert np.abs(y[mid] - ref[mid]).max() < 1e-3


def test_resample_removes_content_above_new_nyquist():
    x = np.sin(2 * np.pi * 15000.0 * np.arange(48000) / 48000).astype(np.float32)  # 15 kHz > 12 kHz
    y = audio.resample(x, 48000, 24000)
    assert np.abs(y[2000:-2000]).max() < 1e-2


def test_resample_identity_odd_ratios_and_errors():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert np.array_equal(audio.resample(x, 24000, 24000), x)
    assert np.array_equal(audio.resample(x, np.int64(24000), 24000.0), x)  # numpy ints, integral floats
    assert audio.resample(x, 24001, 24000).shape == (1000,)  # any integer ratio works (soxr)
    assert audio.resample(np.zeros(0, np.float32), 16000, 24000).shape == (0,)
    for bad in (0, -16000, 22050.5, float("inf"), float("nan"), "16000", None, True, 0.0):
        with pytest.raises(InputError, match=r"orig_sr must be a positive integer.*got " + re.escape(repr(bad))):
            audio.resample(x, bad, 24000)
    with pytest.raises(InputError, match=r"target_sr must be a positive integer.*got -1"):
        audio.resample(x, 16000, -1)
    with pytest.raises(InputError, match="mono"):
        audio.resample(np.zeros((100, 2), np.float32), 48000, 24000)
    for v in (np.nan, np.inf):
        y = x.copy()
        y[10] = v
        with pytest.raises(InputError, match="non-finite"):
            audio.resample(y, 16000, 24000)
    for bad in (0, 22050.5, "16000"):  # e.g. ref_audio=(wav, 22050.5): named, never truncated
        with pytest.raises(InputError, match=r"sample rate must be a positive integer.*got " + re.escape(repr(bad))):
            audio.load_audio(x, sr=bad)


def test_load_wav_mixes_down_and_load_audio_resamples(tmp_path):
    import soundfile as sf

    t = np.arange(4800) / 48000
    stereo = np.stack([0.5 * np.sin(2 * np.pi * 440 * t), np.zeros_like(t)], axis=1)
    path = tmp_path / "ref.wav"
    sf.write(str(path), stereo, 48000, subtype="FLOAT")
    wav, sr = audio.load_wav(path)
    assert sr == 48000 and wav.dtype == np.float32 and wav.shape == (4800,)
    np.testing.assert_allclose(wav, stereo.mean(axis=1), atol=1e-7)
    y = audio.load_audio(path)
    assert y.shape == (2400,)
    assert audio.load_audio(wav, sr=48000).shape == (2400,)
    with pytest.raises(InputError, match="sample rate"):
        audio.load_audio(wav)
    with pytest.raises(InputError, match="not found"):
        audio.load_wav(tmp_path / "missing.wav")
    (tmp_path / "bad.wav").write_bytes(b"not audio")
    with pytest.raises(InputError, match="cannot read"):
        audio.load_wav(tmp_path / "bad.wav")
