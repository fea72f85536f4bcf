"""omnilab.audio: wav loading, resampling, and the speaker-encoder mel front end (vs. librosa/qwen-tts goldens)."""
from __future__ import annotations

import importlib.util
import json
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


@pytest.mark.parametrize("orig_sr", [16000, 22050, 44100, 48000, 8000])
def test_resample_sine_to_24k(orig_sr):
    n = orig_sr // 2  # 0.5 s
    f = 997.0
    x = (0.5 * np.sin(2 * np.pi * f * np.arange(n) / orig_sr)).astype(np.float32)
    y = audio.resample(x, orig_sr, 24000)
    assert y.dtype == np.float32 and len(y) == -(-n * 24000 // orig_sr)
    ref = 0.5 * np.sin(2 * np.pi * f * np.arange(len(y)) / 24000)
    mid = slice(len(y) // 8, -len(y) // 8)  # away from the zero-padded edges
    assert np.abs(y[mid] - ref[mid]).max() < 2e-3


def test_resample_removes_content_above_new_nyquist():
    x = np.sin(2 * np.pi * 15000.0 * np.arange(48000) / 48000).astype(np.float32)  # 15 kHz > 12 kHz
    y = audio.resample(x, 48000, 24000)
    assert np.abs(y[2000:-2000]).max() < 1e-2


def test_resample_identity_and_errors():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert np.array_equal(audio.resample(x, 24000, 24000), x)
    with pytest.raises(InputError, match="orig_sr must be a positive integer"):
        audio.resample(x, 0, 24000)
    with pytest.raises(InputError, match="orig_sr must be a positive integer"):
        audio.resample(x, 22050.5, 24000)
    with pytest.raises(InputError, match="cannot resample 24001->24000"):
        audio.resample(x, 24001, 24000)
    with pytest.raises(InputError, match="mono"):
        audio.resample(np.zeros((100, 2), np.float32), 48000, 24000)


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
