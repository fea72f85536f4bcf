"""Uploaded voices: one safetensors file per voice (24 kHz float32 clip + metadata) under a voices directory,
read back at start, so a voice survives a restart. Names are checked before they touch the file system."""
from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnilab.paths import private_dir
from omnilab.serve.speech import ApiError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SUFFIX = ".safetensors"
MIN_CLIP_SAMPLES = 2400  # 0.1 s at 24 kHz, as the pipeline asks of ref_audio


@dataclass(frozen=True)
class VoiceClip:
    """One uploaded voice: its clip at 24 kHz and what was given with it."""
    name: str
    audio: np.ndarray
    sample_rate: int
    consent: str
    created_at: int
    mime_type: str
    file_size: int
    ref_text: str | None = None
    speaker_description: str | None = None

    def info(self) -> dict[str, Any]:
        """The entry vLLM-Omni lists under ``uploaded_voices`` (optional fields left out when not given)."""
        d = {"name": self.name, "consent": self.consent, "created_at": self.created_at,
             "mime_type": self.mime_type, "file_size": self.file_size}
        if self.ref_text is not None:
            d["ref_text"] = self.ref_text
        if self.speaker_description is not None:
            d["speaker_description"] = self.speaker_description
        return d


class VoiceStore:
    """Voices under ``root`` (created 0700); thread-safe. ``get(name)`` -> ``VoiceClip`` or None."""

    def __init__(self, root: str | os.PathLike, reserved: tuple[str, ...] = ()):
        self.root = private_dir(root)
        self.reserved = {r.lower() for r in reserved}
        self._lock = threading.Lock()
        self._voices: dict[str, VoiceClip] = {}
        self.skipped: dict[str, str] = {}  # unreadable files at start: name -> why (logged, not served)
        for p in sorted(self.root.glob(f"*{SUFFIX}")):
            try:
                clip = _read(p)
                self._voices[clip.name] = clip
            except Exception as e:  # a damaged file must not stop the server; it is reported
                self.skipped[p.name] = f"{type(e).__name__}: {e}"

    def __call__(self, name: str) -> VoiceClip | None:
        return self.get(name)

    def get(self, name: str) -> VoiceClip | None:
        with self._lock:
            return self._voices.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._voices)

    def all(self) -> list[VoiceClip]:
        with self._lock:
            return [self._voices[k] for k in sorted(self._voices)]

    def add(self, name: str, audio: np.ndarray, sample_rate: int, *, consent: str, mime_type: str, file_size: int,
            ref_text: str | None = None, speaker_description: str | None = None) -> VoiceClip:
        """Check and store a voice (24 kHz mono float32 ``audio``); 400/409 naming the problem."""
        check_name(name)
        if name.lower() in self.reserved:
            raise ApiError(409, f"name {name!r} is a built-in speaker of the served model; choose another name", "name")
        if not isinstance(consent, str) or not consent.strip():
            raise ApiError(400, "consent is required: the id of the speaker's consent to clone this voice", "consent")
        if len(audio) < MIN_CLIP_SAMPLES:
            raise ApiError(400, f"audio_sample is {len(audio) / sample_rate:.3f} s long; at least 0.1 s is needed",
                           "audio_sample")
        clip = VoiceClip(name=name, audio=np.ascontiguousarray(audio, dtype=np.float32), sample_rate=sample_rate,
                         consent=consent.strip(), created_at=int(time.time()), mime_type=mime_type,
                         file_size=file_size, ref_text=ref_text or None,
                         speaker_description=speaker_description or None)
        with self._lock:
            if name in self._voices:
                raise ApiError(409, f"voice {name!r} already exists; DELETE /v1/audio/voices/{name} first", "name")
            _write(self.root / f"{name}{SUFFIX}", clip)
            self._voices[name] = clip
        return clip

    def delete(self, name: str) -> None:
        with self._lock:
            if name not in self._voices:
                raise ApiError(404, f"voice {name!r} not found; uploaded: {', '.join(sorted(self._voices)) or 'none'}",
                               "name")
            (self.root / f"{name}{SUFFIX}").unlink(missing_ok=True)
            del self._voices[name]


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ApiError(400, f"name {name!r} is not accepted; accepted: 1-64 characters of letters, digits, '_', '-', "
                            "'.', starting with a letter or digit", "name")
    return name


def _write(path: Path, clip: VoiceClip) -> None:
    import torch
    from safetensors.torch import save_file

    meta = {k: v for k, v in clip.info().items() if k != "name"}
    tmp = path.with_suffix(".tmp")
    save_file({"audio": torch.from_numpy(clip.audio)}, str(tmp),
              metadata={"name": clip.name, "sample_rate": str(clip.sample_rate), "info": json.dumps(meta)})
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)  # atomic: a crash leaves the old file or none, never half of one


def _read(path: Path) -> VoiceClip:
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta = f.metadata() or {}
        audio = f.get_tensor("audio")
    info = json.loads(meta["info"])
    name = check_name(meta.get("name", path.name[:-len(SUFFIX)]))
    if audio.ndim != 1 or audio.dtype != np.float32 or not np.isfinite(audio).all():
        raise ValueError("the clip is not finite float32 [samples]")
    return VoiceClip(name=name, audio=audio, sample_rate=int(meta["sample_rate"]), consent=info["consent"],
                     created_at=int(info["created_at"]), mime_type=info.get("mime_type", "audio/wav"),
                     file_size=int(info.get("file_size", 0)), ref_text=info.get("ref_text"),
                     speaker_description=info.get("speaker_description"))
