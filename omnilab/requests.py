"""Turn user-level synthesis arguments (strings, audio) into a validated ``PromptRequest``.

Contract: everything a user can get wrong is checked here or in ``omnilab.models.prompt.resolve``
and raises ``InputError`` naming the field and the accepted values. VoiceDesign needs a non-blank
``instruct`` (vllm-omni requires one too); ``x_vector_only_mode`` is a bool or None (no truthy strings).
Reference audio is loaded, checked finite, mixed to mono (``[samples]``, ``[samples, channels]`` or
``[channels, samples]``, ``omnilab.audio.to_mono``) and resampled to 24 kHz; Base models turn it into an
x-vector (speaker encoder) and, for ICL cloning, into reference codes (Mimi encoder).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from omnilab.audio import load_audio
from omnilab.errors import InputError
from omnilab.models.prompt import PromptRequest, resolve, split_chat_ids, split_ref_ids

if TYPE_CHECKING:
    from omnilab.checkpoint.load import LoadedModel

MAX_TEXT_CHARS = 20000


@dataclass(frozen=True, eq=False)
class UserRequest:
    """What a caller passed for one utterance (before tokenisation)."""
    text: str | None = None
    input_ids: Sequence[int] | None = None
    speaker: str | None = None
    language: str | None = None
    instruct: str | None = None
    ref_audio: Any = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    non_streaming_mode: bool | None = None


def _audio_arg(ref_audio: Any) -> np.ndarray:
    """``path`` or ``(array, sample_rate)`` -> mono float32 at 24 kHz."""
    try:
        if isinstance(ref_audio, (str, Path)):
            return load_audio(ref_audio)
        if isinstance(ref_audio, tuple) and len(ref_audio) == 2:
            wav, sr = ref_audio
            return load_audio(wav, sr=sr)
    except InputError as e:
        raise InputError(f"ref_audio: {e}") from None
    if isinstance(ref_audio, (np.ndarray, torch.Tensor)):
        raise InputError("ref_audio: an array needs its sample rate; pass ref_audio=(wav, sample_rate) or a file path")
    raise InputError(f"ref_audio must be a file path or a (wav, sample_rate) tuple; got {type(ref_audio).__name__}")


def _text_ids(model: "LoadedModel", req: UserRequest) -> tuple[list[int], str | None]:
    if req.text is not None and req.input_ids is not None:
        raise InputError("pass either text or input_ids, not both")
    if req.input_ids is not None:
        return split_chat_ids(req.input_ids, model.config), None
    if req.text is None:
        raise InputError("text is required (a non-empty string), or input_ids (chat-wrapped token ids)")
    if not isinstance(req.text, str):
        raise InputError(f"text must be a string; got {type(req.text).__name__}")
    text = req.text.strip()
    if not text:
        raise InputError("text is empty or whitespace only; give the sentence to speak")
    if len(text) > MAX_TEXT_CHARS:
        raise InputError(f"text has {len(text)} characters; at most {MAX_TEXT_CHARS} per request (split it)")
    return split_chat_ids(model.tokenizer.chat_wrap_ids(text), model.config), text


def build_request(model: "LoadedModel", req: UserRequest, warn: bool = True) -> tuple[PromptRequest, str | None]:
    """Validate ``req`` for ``model`` and return ``(PromptRequest, stripped text or None)``."""
    cfg = model.config
    text_ids, text = _text_ids(model, req)
    instruct_ids = None
    if req.instruct is not None:
        if not isinstance(req.instruct, str):
            raise InputError(f"instruct must be a string; got {type(req.instruct).__name__}")
        if req.instruct.strip():
            instruct_ids = model.tokenizer.instruct_ids(req.instruct.strip())
    if req.x_vector_only_mode is not None and not isinstance(req.x_vector_only_mode, (bool, np.bool_)):
        raise InputError(f"x_vector_only_mode must be True, False or None (automatic: True without ref_text); got "
                         f"{req.x_vector_only_mode!r} ({type(req.x_vector_only_mode).__name__}): strings are "
                         f"not read as booleans")

    x_vector = ref_codes = ref_text_ids = None
    if cfg.tts_model_type == "base":
        if req.ref_audio is None:
            raise InputError("ref_audio is required for the base (voice clone) model: a file path or (wav, sample_rate)")
        wav = _audio_arg(req.ref_audio)
        if len(wav) < 2400:
            raise InputError(f"ref_audio is {len(wav) / 24000:.3f} s long; at least 0.1 s of speech is needed")
        x_vector = model.speaker_encoder.embed_audio(wav).to(model.dtype)
        if not bool(torch.isfinite(x_vector).all()):  # e.g. samples near float32's limit: never sent to an engine
            raise InputError(f"ref_audio gives a non-finite speaker embedding (largest |sample| "
                             f"{float(np.abs(wav).max()):.3g}); accepted: audio scaled to about [-1, 1]")
        xvec_only = None if req.x_vector_only_mode is None else bool(req.x_vector_only_mode)
        if xvec_only is None:
            xvec_only = req.ref_text is None
        if not xvec_only:
            if req.ref_text is None or not str(req.ref_text).strip():
                raise InputError("ref_text (the transcript of ref_audio) is required for ICL voice cloning; "
                                 "pass x_vector_only_mode=True to clone from the speaker embedding alone")
            codes = model.mimi_encoder.encode(torch.from_numpy(wav)[None])[0]  # [T, 16]
            ref_codes = codes
            ref_text_ids = split_ref_ids(model.tokenizer.ref_text_ids(str(req.ref_text).strip()), cfg)
    else:
        for name in ("ref_audio", "ref_text", "x_vector_only_mode"):
            if getattr(req, name) is not None:
                raise InputError(f"{name} is only accepted by the base (voice clone) model; this model is "
                                 f"{cfg.tts_model_type}")

    prompt_req = PromptRequest(
        text_ids=text_ids, speaker=req.speaker, language=req.language or "auto", instruct_ids=instruct_ids,
        x_vector=x_vector, ref_codes=ref_codes, ref_text_ids=ref_text_ids,
        non_streaming_mode=req.non_streaming_mode)
    resolved = resolve(cfg, prompt_req, warn=warn)
    if cfg.tts_model_type == "voice_design" and resolved.instruct_ids is None:  # vllm-omni refuses it too
        raise InputError(f"instruct is required for the voice_design model (a description of the voice, e.g. "
                         f"instruct='A calm, low male voice.'); got {req.instruct!r}")
    return resolved, text
