"""Talker prompt construction for CustomVoice, VoiceDesign and Base (x-vector and ICL), docs/model.md#prompt-layout.

Contract:
- :class:`PromptRequest` holds token ids (never strings): ``text_ids`` is the *sliced* text part of the chat
  template (``ids[3:-5]``, see :func:`split_chat_ids`), ``instruct_ids`` the whole tokenised
  ``<|im_start|>user\\n{instruct}<|im_end|>\\n``, ``ref_text_ids`` the sliced reference text (``ids[3:-2]``
  of ``<|im_start|>assistant\\n{ref}<|im_end|>\\n``, see :func:`split_ref_ids`).
- :func:`resolve` validates a request against the config (:class:`~omnilab.errors.InputError` naming the
  field and the accepted values) and resolves defaults; an instruct on a model that ignores it is
  dropped with a ``warnings.warn`` (the official package drops it silently).
- :func:`build_prompt` returns the prompt embeddings ``[L, H]``, the trailing text queue ``[N, H]`` and
  ``tts_pad`` ``[H]``. It groups ids into the same text-projection calls as the official builder so the
  vectors are bitwise identical. :func:`prompt_length` is tensor-free and equals ``L`` exactly.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import torch

from omnilab.config import CODEBOOK_SIZE, NUM_CODE_GROUPS, Qwen3TTSConfig
from omnilab.errors import ConfigError, InputError

if TYPE_CHECKING:
    from omnilab.models.talker import Talker

NEWLINE_ID = 198  # "\n" (byte-level BPE "Ċ") in the Qwen2/Qwen3 vocabulary


@dataclass(frozen=True, eq=False)
class PromptRequest:
    """One synthesis request, as token ids and tensors. ``language`` is case-insensitive.

    ``non_streaming_mode`` None = the variant default (CustomVoice/VoiceDesign True, Base False).
    Base: ``x_vector`` [H] is required; ``ref_codes`` [T, 16] + ``ref_text_ids`` select ICL mode."""
    text_ids: Sequence[int]
    speaker: str | None = None
    language: str = "auto"
    instruct_ids: Sequence[int] | None = None
    x_vector: torch.Tensor | None = None
    ref_codes: torch.Tensor | None = None
    ref_text_ids: Sequence[int] | None = None
    non_streaming_mode: bool | None = None


@dataclass(frozen=True, eq=False)
class Prompt:
    embeds: torch.Tensor    # [L, H] prompt input vectors
    trailing: torch.Tensor  # [N, H] text-track vectors added to decode steps 0..N-1
    tts_pad: torch.Tensor   # [H]    text-track vector for decode steps >= N

    def __len__(self) -> int:
        return self.embeds.shape[0]


# ---- chat template slicing -----------------------------------------------------------------------

def _check_ids(ids: Sequence[int], field: str) -> list[int]:
    try:
        out = [int(i) for i in ids]
    except (TypeError, ValueError):
        raise InputError(f"{field} must be a sequence of integer token ids") from None
    if any(isinstance(i, bool) for i in ids):
        raise InputError(f"{field} must be a sequence of integer token ids")
    return out


def split_chat_ids(ids: Sequence[int] | torch.Tensor, cfg: Qwen3TTSConfig) -> list[int]:
    """``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`` ids -> the text ids ``[3:-5]``.

    Raises :class:`InputError` if the template tokens are not where the official slicing expects them
    (e.g. text with leading/trailing newlines that BPE merged into the template)."""
    ids = _check_ids(ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else ids, "input_ids")
    role = [cfg.im_start_token_id, cfg.assistant_token_id, NEWLINE_ID]
    suffix = [cfg.im_end_token_id, NEWLINE_ID] + role
    if len(ids) < 9 or ids[:3] != role or ids[-5:] != suffix:
        raise InputError(
            "input_ids: expected <|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n with at "
            f"least one text token, i.e. ids {role} + text + {suffix}; got {ids[:4]}...{ids[-6:]} "
            "(strip leading/trailing whitespace from the text)")
    return ids[3:-5]


def split_ref_ids(ids: Sequence[int] | torch.Tensor, cfg: Qwen3TTSConfig) -> list[int]:
    """``<|im_start|>assistant\\n{ref_text}<|im_end|>\\n`` ids -> the reference text ids ``[3:-2]``."""
    ids = _check_ids(ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else ids, "ref_ids")
    role = [cfg.im_start_token_id, cfg.assistant_token_id, NEWLINE_ID]
    if len(ids) < 6 or ids[:3] != role or ids[-2:] != [cfg.im_end_token_id, NEWLINE_ID]:
        raise InputError(
            f"ref_ids: expected <|im_start|>assistant\\n{{ref_text}}<|im_end|>\\n, i.e. ids {role} + ref text + "
            f"[{cfg.im_end_token_id}, {NEWLINE_ID}] with at least one ref text token; got {ids[:4]}...{ids[-3:]}")
    return ids[3:-2]


# ---- validation ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    """What a validated request turns into (tensor-free)."""
    instruct_len: int
    language_id: int | None
    speaker_id: int | None       # codec row for CustomVoice
    has_xvector: bool
    icl: bool
    non_streaming: bool
    text_len: int
    ref_text_len: int
    ref_frames: int


def resolve(cfg: Qwen3TTSConfig, req: PromptRequest, warn: bool = True) -> PromptRequest:
    """Validate ``req`` for ``cfg`` and return it with defaults resolved (lower-case names, instruct
    dropped where the model ignores it, ``non_streaming_mode`` set)."""
    tc, kind = cfg.talker, cfg.tts_model_type
    text = _check_ids(req.text_ids, "text_ids")
    if not text:
        raise InputError("text_ids: the text is empty; at least one text token is required")
    _check_range(text, tc.text_vocab_size, "text_ids")

    if not isinstance(req.language, str) or req.language.lower() not in cfg.languages:
        raise InputError(f"language {req.language!r} is not supported; accepted: {', '.join(cfg.languages)}")
    language = req.language.lower()

    speaker = req.speaker
    if kind == "custom_voice":
        if speaker is None or speaker == "":
            raise InputError(f"speaker is required for the custom_voice model; accepted: {', '.join(cfg.speakers)}")
        if not isinstance(speaker, str) or speaker.lower() not in tc.spk_id:
            raise InputError(f"speaker {speaker!r} is not supported; accepted: {', '.join(cfg.speakers)}")
        speaker = speaker.lower()
    elif speaker not in (None, ""):
        hint = "describe the voice with instruct" if kind == "voice_design" else "pass an x_vector to clone a voice"
        raise InputError(f"speaker: the {kind} model has no built-in speakers ({hint}); accepted: None")
    else:
        speaker = None

    instruct = None if req.instruct_ids is None else _check_ids(req.instruct_ids, "instruct_ids")
    if instruct is not None:
        _check_range(instruct, tc.text_vocab_size, "instruct_ids")
        if not instruct:
            instruct = None
        elif not cfg.accepts_instruct:
            if warn:
                warnings.warn(f"instruct is ignored by the {cfg.tts_model_size} {kind} model (the official "
                              "package drops it too); it was not used", stacklevel=3)
            instruct = None

    x_vector, ref_codes, ref_text = req.x_vector, req.ref_codes, req.ref_text_ids
    if kind == "base":
        if x_vector is None:
            raise InputError("x_vector is required for the base model (speaker embedding of the reference audio)")
        if not isinstance(x_vector, torch.Tensor) or x_vector.numel() != tc.hidden_size:
            raise InputError(f"x_vector must be a tensor with {tc.hidden_size} values (talker hidden size); got "
                             f"{tuple(x_vector.shape) if isinstance(x_vector, torch.Tensor) else type(x_vector).__name__}")
        if ref_codes is not None:
            if (not isinstance(ref_codes, torch.Tensor) or ref_codes.dim() != 2
                    or ref_codes.shape[1] != NUM_CODE_GROUPS or ref_codes.shape[0] < 1
                    or ref_codes.is_floating_point()):
                raise InputError(f"ref_codes must be an integer tensor [frames >= 1, {NUM_CODE_GROUPS}]; got "
                                 f"{getattr(ref_codes, 'shape', type(ref_codes).__name__)}")
            if int(ref_codes.min()) < 0 or int(ref_codes.max()) >= CODEBOOK_SIZE:
                raise InputError(f"ref_codes values must be in [0, {CODEBOOK_SIZE - 1}]")
            if ref_text is None or len(ref_text) == 0:
                raise InputError("ref_text_ids are required with ref_codes (ICL voice clone needs the reference "
                                 "transcript); pass no ref_codes for x-vector-only cloning")
            ref_text = _check_ids(ref_text, "ref_text_ids")
            _check_range(ref_text, tc.text_vocab_size, "ref_text_ids")
        elif ref_text is not None and len(ref_text) > 0:
            raise InputError("ref_text_ids were given without ref_codes; ICL needs both (or neither for x-vector mode)")
        else:
            ref_text = None
    else:
        for name, v in (("x_vector", x_vector), ("ref_codes", ref_codes), ("ref_text_ids", ref_text)):
            if v is not None:
                raise InputError(f"{name} is only accepted by the base model (this is {kind})")

    nsm = req.non_streaming_mode
    if nsm is None:
        nsm = kind != "base"
    elif not isinstance(nsm, bool):
        raise InputError(f"non_streaming_mode must be True, False or None (variant default); got {nsm!r}")
    return replace(req, text_ids=text, speaker=speaker, language=language, instruct_ids=instruct,
                   ref_text_ids=ref_text, non_streaming_mode=nsm)


def _check_range(ids: list[int], vocab: int, field: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise InputError(f"{field}: token ids must be in [0, {vocab - 1}]; got {bad[:5]}")


def _plan(cfg: Qwen3TTSConfig, req: PromptRequest) -> _Plan:
    tc = cfg.talker
    language_id = None if req.language == "auto" else tc.codec_language_id[req.language]
    if req.language in ("chinese", "auto") and req.speaker is not None:
        dialect = tc.spk_is_dialect.get(req.speaker, False)
        if dialect is not False and dialect is not None:
            if dialect not in tc.codec_language_id:
                raise ConfigError(f"spk_is_dialect[{req.speaker!r}] = {dialect!r} is not a codec_language_id key")
            language_id = tc.codec_language_id[dialect]
    icl = req.ref_codes is not None
    return _Plan(
        instruct_len=len(req.instruct_ids or ()), language_id=language_id,
        speaker_id=tc.spk_id[req.speaker] if req.speaker is not None else None,
        has_xvector=req.x_vector is not None, icl=icl, non_streaming=bool(req.non_streaming_mode),
        text_len=len(req.text_ids), ref_text_len=len(req.ref_text_ids or ()),
        ref_frames=int(req.ref_codes.shape[0]) if icl else 0)


def _codec_prefix(cfg: Qwen3TTSConfig, plan: _Plan) -> tuple[list[int], list[int]]:
    """(tag ids, [pad, bos]); the speaker slot (if any) goes between them."""
    tc = cfg.talker
    if plan.language_id is None:
        tags = [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
    else:
        tags = [tc.codec_think_id, tc.codec_think_bos_id, plan.language_id, tc.codec_think_eos_id]
    return tags, [tc.codec_pad_id, tc.codec_bos_id]


def _lengths(cfg: Qwen3TTSConfig, plan: _Plan) -> tuple[int, int]:
    """(prompt length L, trailing length N)."""
    tags, tail = _codec_prefix(cfg, plan)
    n_codec = len(tags) + int(plan.speaker_id is not None or plan.has_xvector) + len(tail)
    head = plan.instruct_len + 3 + (n_codec - 1)
    if plan.icl:
        lt, lc = plan.ref_text_len + plan.text_len + 1, 1 + plan.ref_frames
        if plan.non_streaming:
            return head + lt + lc, 1
        return head + lc, (lt - lc if lt > lc else 1)
    if plan.non_streaming:
        return head + plan.text_len + 2, 1
    return head + 1, plan.text_len


def codec_prefix_ids(cfg: Qwen3TTSConfig, req: PromptRequest) -> list[int]:
    """Codec-track ids of the prompt prefix: tags (language incl. the dialect override), the speaker
    slot (CustomVoice speaker id; -1 marks the Base x-vector slot), then pad, bos."""
    plan = _plan(cfg, resolve(cfg, req, warn=False))
    tags, tail = _codec_prefix(cfg, plan)
    slot = [plan.speaker_id] if plan.speaker_id is not None else ([-1] if plan.has_xvector else [])
    return tags + slot + tail


def prompt_length(cfg: Qwen3TTSConfig, req: PromptRequest) -> int:
    """Number of prompt positions :func:`build_prompt` produces for ``req`` (no tensors touched)."""
    return _lengths(cfg, _plan(cfg, resolve(cfg, req, warn=False)))[0]


def trailing_length(cfg: Qwen3TTSConfig, req: PromptRequest) -> int:
    """Rows of the trailing text queue (1 = just ``tts_pad``)."""
    return _lengths(cfg, _plan(cfg, resolve(cfg, req, warn=False)))[1]


# ---- embeddings ----------------------------------------------------------------------------------

@torch.inference_mode()
def build_prompt(talker: "Talker", cfg: Qwen3TTSConfig, req: PromptRequest) -> Prompt:
    """Prompt embeddings for one request (docs/model.md#prompt-layout), in the talker's dtype."""
    req = resolve(cfg, req)
    plan = _plan(cfg, req)
    T, C = talker.embed_text, talker.embed_codec
    tb, te, tp = T([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id])  # each [H]
    tb, te, tp = tb[None], te[None], tp[None]  # [1, H]

    tags, tail = _codec_prefix(cfg, plan)
    codec = [C(tags)]
    if plan.speaker_id is not None:
        codec.append(C([plan.speaker_id]))
    elif plan.has_xvector:
        codec.append(req.x_vector.reshape(1, -1).to(talker.dtype))
    codec.append(C(tail))
    codec = torch.cat(codec, dim=0)  # [n, H]; last row is C(bos)
    n = codec.shape[0]

    parts = []
    if req.instruct_ids:
        parts.append(T(req.instruct_ids))
    parts.append(T([cfg.im_start_token_id, cfg.assistant_token_id, NEWLINE_ID]))
    parts.append(torch.cat([tp.expand(n - 2, -1), tb], dim=0) + codec[:-1])

    text = list(req.text_ids)
    if plan.icl:
        icl, trailing = _icl_block(talker, cfg, req, te, tp)
        parts.append(icl)
    elif plan.non_streaming:
        parts.append(torch.cat([T(text), te], dim=0) + C([cfg.talker.codec_pad_id] * (len(text) + 1)))
        parts.append(tp + C([cfg.talker.codec_bos_id]))
        trailing = tp
    else:
        parts.append(T(text[:1]) + codec[-1:])
        trailing = torch.cat([T(text[1:]), te], dim=0)
    return Prompt(embeds=torch.cat(parts, dim=0), trailing=trailing, tts_pad=tp[0])


def _icl_block(talker: "Talker", cfg: Qwen3TTSConfig, req: PromptRequest, te: torch.Tensor, tp: torch.Tensor):
    """Base ICL: text track ``T(ref ++ text) ++ T(eos)``, codec track ``C(bos) ++ frame sums of ref_codes``."""
    text = talker.embed_text(list(req.ref_text_ids) + list(req.text_ids))
    text = torch.cat([text, te], dim=0)  # [Lt, H]
    ref = req.ref_codes.to(dtype=torch.long, device=talker.codec_head.weight.device)
    codec = torch.cat([talker.embed_codec([cfg.talker.codec_bos_id]), talker.embed_frame(ref)], dim=0)  # [Lc, H]
    lt, lc = text.shape[0], codec.shape[0]
    if req.non_streaming_mode:
        block = torch.cat([text + talker.embed_codec([cfg.talker.codec_pad_id] * lt), codec + tp], dim=0)
        return block, tp
    if lt > lc:
        return text[:lc] + codec, text[lc:]
    text = torch.cat([text] + [tp] * (lc - lt), dim=0)
    return text + codec, tp
