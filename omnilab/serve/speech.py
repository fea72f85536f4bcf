"""``POST /v1/audio/speech`` bodies -> ``Pipeline.stream`` keyword arguments, and audio encoding.

Contract: ``parse_speech(body, ctx)`` checks what only the HTTP layer knows (field names, response format,
speed, sample rate, streaming mode, the server's caps, task type against the served model, ref_audio locators)
and raises ``ApiError`` (status + message naming the field and the accepted values). Everything else (text,
voice/speaker, language, instructions, sampling values, the reference clip's content) is left to the pipeline's
own validation (``omnilab.requests.build_request``, ``SamplingParams.validate``), which runs when the stream is
created, before any byte is sent, so HTTP and Python callers get the same checks and messages.
"""
from __future__ import annotations

import base64
import binascii
import io
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from omnilab.config import SAMPLE_RATE

RESPONSE_FORMATS = ("wav", "pcm", "flac")
REFUSED_FORMATS = ("mp3", "opus", "aac")  # no maintained encoder wheel in this environment
SAMPLE_RATES = (8000, 24000)
STREAM_FORMATS = ("audio", "sse")
TASK_TYPES = {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "base"}
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}
FIELDS = ("input", "model", "voice", "response_format", "speed", "task_type", "language", "instructions",
          "max_new_tokens", "initial_codec_chunk_frames", "non_streaming_mode", "sample_rate", "ref_audio",
          "ref_text", "x_vector_only_mode", "temperature", "top_k", "top_p", "seed", "stream", "stream_format")
MAX_INITIAL_CHUNK_FRAMES = 25


class ApiError(Exception):
    """An HTTP error answer: ``status`` and a message naming the problem and the accepted values."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(frozen=True)
class SpeechContext:
    """What parsing needs from the server: the served model, caps and the voice store."""
    model_type: str                              # custom_voice | voice_design | base
    model_names: tuple[str, ...]                 # ids accepted in `model`
    max_input_chars: int
    max_new_tokens: int
    max_upload_bytes: int
    allowed_media_dir: str | None
    voice_clip: Callable[[str], Any]             # uploaded voice name -> VoiceClip or None
    default_voice: str | None = None             # CustomVoice: used when `voice` is omitted (vLLM-Omni: vivian)


@dataclass
class SpeechRequest:
    """A parsed request: pipeline keyword arguments plus the HTTP-only choices."""
    text: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    response_format: str = "wav"
    sample_rate: int = SAMPLE_RATE
    stream_format: str | None = None             # None: one complete body
    initial_chunk_frames: int | None = None
    voice: str | None = None


def _type_name(v: Any) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _opt_str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise ApiError(400, f"{name} must be a string; got {_type_name(v)} {v!r}", name)
    return v


def _opt_bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, f"{name} must be true, false or null; got {_type_name(v)} {v!r}", name)
    return v


def _opt_int(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise ApiError(400, f"{name} must be an integer; got {_type_name(v)} {v!r}", name)
    return v


def parse_speech(body: Any, ctx: SpeechContext, *, streaming_only: bool = False) -> SpeechRequest:
    """Check an HTTP speech body (a JSON object) -> ``SpeechRequest``; raises ``ApiError``."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object; got {_type_name(body)}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ApiError(400, f"unknown field(s) {unknown}; accepted: {', '.join(FIELDS)}", unknown[0])
    text = body.get("input")
    if text is None:
        raise ApiError(400, "input is required: the text to speak (a non-empty string)", "input")
    if not isinstance(text, str):
        raise ApiError(400, f"input must be a string; got {_type_name(text)}", "input")
    if len(text) > ctx.max_input_chars:
        raise ApiError(400, f"input has {len(text)} characters; at most {ctx.max_input_chars} per request "
                            f"(--max-input-chars)", "input")
    model = _opt_str(body, "model")
    if model not in (None, "", *ctx.model_names):
        raise ApiError(400, f"model {model!r} is not served here; accepted: {', '.join(ctx.model_names)}", "model")

    fmt = _opt_str(body, "response_format") or "wav"
    if fmt not in RESPONSE_FORMATS:
        why = " (no encoder for it on this server)" if fmt in REFUSED_FORMATS else ""
        raise ApiError(400, f"response_format {fmt!r} is not supported{why}; accepted: {', '.join(RESPONSE_FORMATS)}",
                       "response_format")
    speed = body.get("speed")
    if speed is not None:
        if not isinstance(speed, (int, float)) or isinstance(speed, bool) or not math.isfinite(speed):
            raise ApiError(400, f"speed must be a number; got {_type_name(speed)} {speed!r}", "speed")
        if speed != 1.0:
            raise ApiError(400, f"speed {speed} is not supported: Qwen3-TTS speaks at its own pace; accepted: 1.0",
                           "speed")
    sr = _opt_int(body, "sample_rate")
    if sr is not None and sr not in SAMPLE_RATES:
        raise ApiError(400, f"sample_rate {sr} is not supported; accepted: {', '.join(map(str, SAMPLE_RATES))}",
                       "sample_rate")
    stream = _opt_bool(body, "stream")
    stream_format = _opt_str(body, "stream_format")
    if stream_format is not None and stream_format not in STREAM_FORMATS:
        raise ApiError(400, f"stream_format {stream_format!r} is not supported; accepted: "
                            f"{', '.join(STREAM_FORMATS)}", "stream_format")
    if stream_format is None and stream:
        stream_format = "sse"
    if stream_format is not None and fmt not in ("pcm", "wav"):
        raise ApiError(400, f"streaming needs response_format pcm or wav; got {fmt!r}", "response_format")
    ic = _opt_int(body, "initial_codec_chunk_frames")
    if ic is not None and not (1 <= ic <= MAX_INITIAL_CHUNK_FRAMES):
        raise ApiError(400, f"initial_codec_chunk_frames must be in [1, {MAX_INITIAL_CHUNK_FRAMES}]; got {ic}",
                       "initial_codec_chunk_frames")
    mnt = body.get("max_new_tokens")
    if isinstance(mnt, int) and not isinstance(mnt, bool) and mnt > ctx.max_new_tokens:
        raise ApiError(400, f"max_new_tokens {mnt} is over this server's cap of {ctx.max_new_tokens} "
                            f"(--max-new-tokens)", "max_new_tokens")

    voice = body.get("voice")
    ref_audio, ref_text = body.get("ref_audio"), body.get("ref_text")
    clip = ctx.voice_clip(voice) if isinstance(voice, str) and voice else None
    task = _opt_str(body, "task_type")
    if task is not None and task not in TASK_TYPES:
        raise ApiError(400, f"task_type {task!r} is not known; accepted: {', '.join(TASK_TYPES)}", "task_type")
    if task is None:  # vLLM-Omni's inference: a clip, a transcript or an uploaded voice -> Base, else CustomVoice
        task = "Base" if (ref_audio is not None or ref_text is not None or clip is not None) else "CustomVoice"
        inferred = " (inferred: give task_type explicitly)"
    else:
        inferred = ""
    served = next(k for k, v in TASK_TYPES.items() if v == ctx.model_type)
    if inferred and ctx.model_type == "base" and isinstance(voice, str) and voice and clip is None:
        raise ApiError(400, f"voice {voice!r} is not an uploaded voice; accepted: "
                            f"{', '.join(clip_names(ctx)) or 'none uploaded yet (POST /v1/audio/voices)'}, "
                            "or a ref_audio clip", "voice")
    if TASK_TYPES[task] != ctx.model_type:
        raise ApiError(400, f"task_type {task}{inferred} does not match the served model, a {served} checkpoint; "
                            f"accepted: {served}", "task_type")

    kw: dict[str, Any] = {}
    if ctx.model_type == "custom_voice":
        kw["speaker"] = ctx.default_voice if voice is None else voice
    elif ctx.model_type == "base":
        if clip is not None:
            if ref_audio is not None:
                raise ApiError(400, f"voice {voice!r} is an uploaded voice; give either it or ref_audio, not both",
                               "ref_audio")
            kw["ref_audio"] = (clip.audio, clip.sample_rate)
            if ref_text is None:
                ref_text = clip.ref_text
        elif voice not in (None, ""):
            raise ApiError(400, f"voice {voice!r} is not an uploaded voice; accepted: "
                                f"{', '.join(clip_names(ctx)) or 'none uploaded yet (POST /v1/audio/voices)'}", "voice")
        elif ref_audio is not None:
            kw["ref_audio"] = decode_ref_audio(ref_audio, ctx)
        kw["ref_text"] = ref_text
        kw["x_vector_only_mode"] = body.get("x_vector_only_mode")
    else:  # VoiceDesign: the voice comes from `instructions`; a `voice` is refused by the pipeline, not dropped
        kw["speaker"] = voice
        for name in ("ref_audio", "ref_text", "x_vector_only_mode"):
            if body.get(name) is not None:
                raise ApiError(400, f"{name} is only accepted by a Base (voice clone) model; this one is {served}",
                               name)
    if ctx.model_type == "custom_voice":
        for name in ("ref_audio", "ref_text", "x_vector_only_mode"):
            if body.get(name) is not None:
                raise ApiError(400, f"{name} is only accepted by a Base (voice clone) model; this one is {served}",
                               name)
    kw["language"] = body.get("language")
    kw["instruct"] = body.get("instructions")
    kw["non_streaming_mode"] = body.get("non_streaming_mode")
    for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed"):
        kw[name] = body.get(name)
    if isinstance(kw["language"], str):
        kw["language"] = kw["language"].lower()
    if ctx.model_type == "voice_design" and kw["instruct"] is None:
        kw["instruct"] = ""  # the pipeline answers with its own message naming instructions
    return SpeechRequest(text=text, kwargs=kw, response_format=fmt, sample_rate=sr or SAMPLE_RATE,
                         stream_format=stream_format, initial_chunk_frames=ic, voice=voice)


def clip_names(ctx: SpeechContext) -> list[str]:
    return list(getattr(ctx.voice_clip, "names", lambda: [])())


def decode_ref_audio(ref: Any, ctx: SpeechContext) -> Any:
    """``ref_audio`` locator -> ``(samples, sample_rate)`` or a path; base64 data URLs and ``file://`` under the
    allowed directory. http(s) is refused: this server makes no network requests."""
    if not isinstance(ref, str):
        raise ApiError(400, f"ref_audio must be a string (a base64 data URL or a file:// URI); got {_type_name(ref)}",
                       "ref_audio")
    if ref.startswith(("http://", "https://")):
        raise ApiError(400, "ref_audio: http(s) URLs are refused (this server makes no network requests); "
                            "accepted: a base64 data URL (data:audio/wav;base64,...) or a file:// URI under "
                            "--allowed-media-dir", "ref_audio")
    if ref.startswith("file://"):
        if ctx.allowed_media_dir is None:
            raise ApiError(400, "ref_audio: file:// URIs are refused: the server was started without "
                                "--allowed-media-dir; accepted: a base64 data URL", "ref_audio")
        root = os.path.realpath(ctx.allowed_media_dir)
        path = os.path.realpath(ref[len("file://"):])
        if os.path.commonpath([root, path]) != root:
            raise ApiError(400, f"ref_audio: {ref[len('file://'):]!r} is outside the allowed media directory "
                                f"{ctx.allowed_media_dir!r} (--allowed-media-dir)", "ref_audio")
        if not os.path.isfile(path):
            raise ApiError(400, f"ref_audio: no file at {ref[len('file://'):]!r}", "ref_audio")
        if os.path.getsize(path) > ctx.max_upload_bytes:
            raise ApiError(413, f"ref_audio: the file has {os.path.getsize(path)} bytes; at most "
                                f"{ctx.max_upload_bytes} (--max-upload-bytes)", "ref_audio")
        return read_audio_bytes(Path(path).read_bytes(), "ref_audio")
    if ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        if not head.endswith(";base64") or not payload:
            raise ApiError(400, "ref_audio: a data URL must be base64: data:audio/wav;base64,<data>", "ref_audio")
        if len(payload) * 3 // 4 > ctx.max_upload_bytes:
            raise ApiError(413, f"ref_audio: about {len(payload) * 3 // 4} bytes of audio; at most "
                                f"{ctx.max_upload_bytes} (--max-upload-bytes)", "ref_audio")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "ref_audio: the data URL's payload is not valid base64", "ref_audio") from None
        return read_audio_bytes(raw, "ref_audio")
    raise ApiError(400, "ref_audio: not a locator this server reads; accepted: a base64 data URL "
                        "(data:audio/wav;base64,...) or a file:// URI under --allowed-media-dir", "ref_audio")


def read_audio_bytes(raw: bytes, name: str) -> tuple[np.ndarray, int]:
    """Encoded audio (wav, flac, ogg: what libsndfile reads) -> ``(float32 samples, sample_rate)``; the content
    (finite, mono mix, length) is checked by the pipeline's own ``ref_audio`` validation."""
    import soundfile as sf

    try:
        wav, sr = sf.read(io.BytesIO(raw), dtype="float32", always_2d=False)
    except Exception as e:  # libsndfile's errors carry no type worth keeping
        raise ApiError(400, f"{name}: not a readable audio file ({str(e).strip() or type(e).__name__}); "
                            "accepted: wav, flac, ogg") from None
    return np.asarray(wav), int(sr)


# ---------------------------------------------------------------------------------------------- encoding

def to_rate(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """24 kHz float32 -> ``sample_rate`` (8000 through the project's soxr resampler)."""
    if sample_rate == SAMPLE_RATE or not len(audio):
        return audio
    from omnilab.audio import resample  # lazy: torch

    return resample(audio, SAMPLE_RATE, sample_rate)


def pcm16(audio: np.ndarray) -> bytes:
    """float32 [-1, 1] -> signed 16-bit little-endian bytes (clipped)."""
    return (np.clip(np.nan_to_num(audio), -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """A 44-byte PCM16 mono WAV header; ``data_bytes`` None = unknown length (streaming: 0xFFFFFFFF sizes)."""
    n = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
                                                                            sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", n))


def encode(audio: np.ndarray, fmt: str, sample_rate: int) -> bytes:
    """A whole clip (24 kHz float32) -> bytes in ``fmt`` at ``sample_rate``."""
    audio = to_rate(audio, sample_rate)
    if fmt == "pcm":
        return pcm16(audio)
    if fmt == "wav":
        data = pcm16(audio)
        return wav_header(sample_rate, len(data)) + data
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.clip(audio, -1.0, 1.0), sample_rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()
