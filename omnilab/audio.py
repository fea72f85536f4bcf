"""Audio input utilities: wav loading, mono mixdown, resampling, and the speaker-encoder mel front end.

Contract:
- ``load_wav(path) -> (wav [samples] float32, sample_rate)`` reads any file soundfile can read and mixes
  multi-channel audio down to mono by averaging the channels (as the official package does). Arrays may be
  ``[samples]``, ``[samples, channels]`` or ``[channels, samples]`` (the channel axis is the shorter one, at most 8
  long; ``to_mono``); other layouts raise ``InputError``.
- ``resample(wav, orig_sr, target_sr)`` resamples exactly as the official package does for references not at
  24 kHz: ``librosa.resample(y=wav.astype(np.float32), orig_sr=int(sr), target_sr=24000)`` with librosa's
  defaults (``res_type="soxr_hq"``, ``fix=True``, ``scale=False``). That is ``soxr.resample(x, orig_sr,
  target_sr, quality="soxr_hq")`` (python-soxr, imported lazily) on the contiguous float32 signal, then
  librosa's length rule: cut or zero-padded to ``int(np.ceil(samples * (float(target_sr) / orig_sr)))``
  samples (a float ratio, as librosa computes it: 44100 samples at 44.1 kHz give 24001), float32. Bit-equal to
  the official resampling (both run the same python-soxr; its soxr_hq float32 engine has no CPU-dependent
  paths). Equal rates return the float32 signal unchanged. Rates must be positive integers (``int``, numpy
  integers or integral floats such as ``22050.0``); anything else raises ``InputError`` naming the value, and
  so do non-finite samples.
- ``load_audio(x, sr=None, target_sr=24000)`` accepts a path or an array (with ``sr``) and returns float32 mono
  at ``target_sr``.
- ``mel_filterbank_slaney`` reproduces ``librosa.filters.mel(htk=False, norm="slaney")`` (float32 result with
  the same float64 intermediate steps), and ``log_mel_spectrogram`` reproduces ``mel_spectrogram`` +
  ``extract_speaker_embedding`` of qwen-tts: reflect pad (n_fft - hop) // 2 on both sides, ``center=False``,
  periodic Hann window, magnitude sqrt(re^2 + im^2 + 1e-9), log(clamp(x, 1e-5)). Output ``[B, frames, n_mels]``
  with ``frames = samples // hop`` (for samples >= hop).
"""
from __future__ import annotations

import functools
import math
import numbers
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from omnilab.config import SAMPLE_RATE
from omnilab.errors import InputError

# Mel front end of the Base speaker encoder (hard-coded in the reference ``extract_speaker_embedding``).
SPK_N_FFT = 1024
SPK_HOP_SAMPLES = 256
SPK_WIN_SAMPLES = 1024
SPK_N_MELS = 128
SPK_FMIN_HZ = 0.0
SPK_FMAX_HZ = 12000.0


# ----------------------------------------------------------------------------------------------- files

MAX_CHANNELS = 8  # 7.1 audio; a longer axis is the time axis


def to_mono(wav: np.ndarray) -> np.ndarray:
    """``[samples]`` stays; ``[samples, channels]`` (soundfile's layout) and ``[channels, samples]`` (torchaudio's)
    are averaged over the channel axis: the shorter one, with at most :data:`MAX_CHANNELS` entries. Anything else
    (3-D, two long axes, a square array) raises ``InputError`` naming the accepted layouts."""
    wav = np.asarray(wav)
    if wav.dtype.kind not in "fiub":
        raise InputError(f"audio must be a numeric array; got dtype {wav.dtype}")
    if wav.ndim == 1:
        return wav.astype(np.float32, copy=False)
    if wav.ndim == 2 and wav.shape[0] != wav.shape[1] and min(wav.shape) <= MAX_CHANNELS:
        axis = 0 if wav.shape[0] < wav.shape[1] else 1
        return wav.astype(np.float32).mean(axis=axis)
    raise InputError(f"audio must be [samples], [samples, channels] or [channels, samples] with at most "
                     f"{MAX_CHANNELS} channels (the shorter axis); got shape {tuple(wav.shape)}")


def load_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Read an audio file with soundfile. Returns ``(wav [samples] float32 mono, sample_rate)``."""
    import soundfile as sf

    path = Path(path)
    if not path.is_file():
        raise InputError(f"audio file not found: {path}")
    try:
        wav, sr = sf.read(str(path), dtype="float32", always_2d=False)
    except RuntimeError as e:  # soundfile raises LibsndfileError (a RuntimeError) on unreadable files
        raise InputError(f"cannot read audio file {path}: {e}") from None
    return to_mono(wav), int(sr)


def load_audio(x: str | Path | np.ndarray | torch.Tensor, sr: int | None = None,
               target_sr: int = SAMPLE_RATE) -> np.ndarray:
    """Path, or array plus ``sr`` -> float32 mono ``[samples]`` at ``target_sr``."""
    if isinstance(x, (str, Path)):
        wav, sr = load_wav(x)
    else:
        if sr is None:
            raise InputError("an audio array needs its sample rate: pass sr=<Hz>")
        wav = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        wav = to_mono(wav)
    return resample(wav, _check_rate("sample rate", sr), _check_rate("target_sr", target_sr))


# ----------------------------------------------------------------------------------------- resampling

def _check_rate(name: str, sr) -> int:
    """A sample rate as ``int``: a positive integer (``int``, numpy integer, or an integral float)."""
    ok = (isinstance(sr, numbers.Real) and not isinstance(sr, (bool, np.bool_))
          and math.isfinite(float(sr)) and float(sr).is_integer() and float(sr) > 0)
    if not ok:
        raise InputError(f"{name} must be a positive integer number of Hz; got {sr!r}")
    return int(sr)


def resample(wav: np.ndarray | torch.Tensor, orig_sr: int, target_sr: int) -> np.ndarray:
    """Resample a mono ``[samples]`` signal as qwen-tts does (librosa's default ``soxr_hq``). Returns float32.

    Same result as ``librosa.resample(y=wav.astype(np.float32), orig_sr=orig_sr, target_sr=target_sr)``:
    ``soxr.resample(..., quality="soxr_hq")`` fixed to ``int(np.ceil(samples * (float(target_sr) / orig_sr)))``
    samples (trailing zeros added or samples cut). Identity (as float32) when the rates are equal.
    """
    orig_sr = _check_rate("orig_sr", orig_sr)
    target_sr = _check_rate("target_sr", target_sr)
    x = wav.detach().cpu().numpy() if isinstance(wav, torch.Tensor) else wav
    x = np.ascontiguousarray(x, dtype=np.float32)  # the official call passes ``astype(np.float32)`` (a copy)
    if x.ndim != 1:
        raise InputError(f"resample expects mono [samples]; got shape {tuple(x.shape)} (mix down with to_mono)")
    finite = np.isfinite(x)
    if not finite.all():
        raise InputError(f"audio has {int(x.size - finite.sum())} non-finite samples (NaN or inf) of {x.size}; "
                         "accepted: finite samples")
    if orig_sr == target_sr:
        return x
    n_out = int(np.ceil(x.shape[0] * (float(target_sr) / orig_sr)))  # librosa's length rule, float ratio
    if x.shape[0] == 0:
        return np.zeros(0, dtype=np.float32)
    import soxr  # lazy: keeps ``import omnilab`` light

    y = soxr.resample(x, orig_sr, target_sr, quality="soxr_hq")
    if y.shape[0] > n_out:
        y = y[:n_out]
    elif y.shape[0] < n_out:
        y = np.pad(y, (0, n_out - y.shape[0]), mode="constant")
    return np.ascontiguousarray(y, dtype=np.float32)


# ------------------------------------------------------------------------------------------ mel front end

def _hz_to_mel_slaney(f: np.ndarray) -> np.ndarray:
    """Slaney (Auditory Toolbox) mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    lin = f / f_sp
    log = min_log_mel + np.log(np.maximum(f, min_log_hz) / min_log_hz) / logstep
    return np.where(f >= min_log_hz, log, lin)


def _mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    lin = f_sp * m
    log = min_log_hz * np.exp(logstep * (np.maximum(m, min_log_mel) - min_log_mel))
    return np.where(m >= min_log_mel, log, lin)


@functools.lru_cache(maxsize=8)
def _mel_filterbank_cached(sr: int, n_fft: int, n_mels: int, fmin_hz: float, fmax_hz: float) -> np.ndarray:
    fft_hz = np.arange(n_fft // 2 + 1) * (1.0 / (n_fft * (1.0 / sr)))  # rfft bin centres (numpy's rfftfreq)
    edges_mel = np.linspace(_hz_to_mel_slaney(fmin_hz), _hz_to_mel_slaney(fmax_hz), n_mels + 2)
    edges_hz = _mel_to_hz_slaney(edges_mel)  # [n_mels + 2]
    widths_hz = np.diff(edges_hz)
    dist = edges_hz[:, None] - fft_hz[None, :]  # [n_mels + 2, bins]
    weights = np.zeros((n_mels, n_fft // 2 + 1), dtype=np.float32)
    for i in range(n_mels):  # triangle i rises over [edge i, edge i+1] and falls over [edge i+1, edge i+2]
        rising = -dist[i] / widths_hz[i]
        falling = dist[i + 2] / widths_hz[i + 1]
        weights[i] = np.maximum(0.0, np.minimum(rising, falling))  # rounded to float32 here (as librosa)
    area_norm = 2.0 / (edges_hz[2:n_mels + 2] - edges_hz[:n_mels])  # slaney: constant energy per band
    weights *= area_norm[:, None]
    weights.setflags(write=False)
    return weights


def mel_filterbank_slaney(sr: int = SAMPLE_RATE, n_fft: int = SPK_N_FFT, n_mels: int = SPK_N_MELS,
                          fmin_hz: float = SPK_FMIN_HZ, fmax_hz: float | None = SPK_FMAX_HZ) -> np.ndarray:
    """``[n_mels, n_fft // 2 + 1]`` float32, equal to ``librosa.filters.mel(sr=..., htk=False, norm='slaney')``.

    The returned array is read-only and shared (cached); copy it before modifying.
    """
    fmax_hz = sr / 2.0 if fmax_hz is None else float(fmax_hz)
    return _mel_filterbank_cached(int(sr), int(n_fft), int(n_mels), float(fmin_hz), fmax_hz)


def log_mel_spectrogram(wav: np.ndarray | torch.Tensor, *, sr: int = SAMPLE_RATE, n_fft: int = SPK_N_FFT,
                        hop_samples: int = SPK_HOP_SAMPLES, win_samples: int = SPK_WIN_SAMPLES,
                        n_mels: int = SPK_N_MELS, fmin_hz: float = SPK_FMIN_HZ,
                        fmax_hz: float = SPK_FMAX_HZ) -> torch.Tensor:
    """Speaker-encoder features: ``wav [samples] or [B, samples]`` -> ``[B, frames, n_mels]`` float32.

    ``frames = 1 + (samples + 2 * ((n_fft - hop) // 2) - n_fft) // hop``; 24 kHz defaults give samples // 256.
    """
    y = wav if isinstance(wav, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(wav))
    y = y.to(torch.float32)
    if y.ndim == 1:
        y = y[None]
    if y.ndim != 2:
        raise InputError(f"log_mel_spectrogram expects [samples] or [B, samples]; got {tuple(y.shape)}")
    pad = (n_fft - hop_samples) // 2
    if y.shape[-1] <= pad:
        raise InputError(f"audio too short for the mel front end: {y.shape[-1]} samples; need more than {pad} "
                         f"({1000 * (pad + 1) / sr:.0f} ms at {sr} Hz)")
    basis = torch.from_numpy(mel_filterbank_slaney(sr, n_fft, n_mels, fmin_hz, fmax_hz).copy()).to(y.device)
    y = F.pad(y[:, None, :], (pad, pad), mode="reflect")[:, 0, :]
    spec = torch.stft(y, n_fft, hop_length=hop_samples, win_length=win_samples,
                      window=torch.hann_window(win_samples, device=y.device), center=False,
                      normalized=False, onesided=True, return_complex=True)  # [B, bins, frames]
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = torch.matmul(basis, mag)  # [B, n_mels, frames]
    return torch.log(torch.clamp(mel, min=1e-5)).transpose(1, 2)
