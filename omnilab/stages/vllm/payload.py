"""The per-request, per-step record the vLLM talker worker returns through ``pooler_output``.

Contract: one float32 tensor per request row of an engine step (vLLM carries it to the client as
``PoolingRequestOutput.outputs.data``, in-process and across processes). Fields, in order: whether a
frame was produced (1; 0 none; -1 none because the row's talker logits were not finite, ``nonfinite``), its
0-based index, the 16 codes, the step's phase timings in ms, the number of rows
that produced a frame in this step, the tokens scheduled in the step, the runner's step counter, when the
worker began and ended the step (``perf_counter`` s, each in three slots: ``s >> 16``, ``s & 0xFFFF``, the
fraction; exact to ~60 ns) and optionally the talker hidden state that produced c0. Codes and indices are
exact in float32 (< 2**24).
No vLLM import.
"""
from __future__ import annotations

import os
import threading
from typing import Any

import torch

from omnilab.models.prompt import PromptRequest
from omnilab.sampling import SamplingParams

FIELDS = ("has_frame", "frame_index") + tuple(f"c{q}" for q in range(16)) + (
    "prefill_ms", "input_prep_ms", "talker_ms", "predictor_ms", "sampling_ms", "engine_ms", "cycle_ms",
    "batch_rows", "scheduled_tokens", "step", "pid", "tid",
    "start_hi", "start_lo", "start_frac", "end_hi", "end_lo", "end_frac", "hidden_size")
HEADER = len(FIELDS)
_CODES = slice(2, 18)
_MS_FIELDS = ("prefill_ms", "input_prep_ms", "talker_ms", "predictor_ms", "sampling_ms", "engine_ms", "cycle_ms")
# what a decoded record gives the client's frame output: the ms fields and the worker's step window (s)
TIMING_FIELDS = _MS_FIELDS + ("worker_start_s", "worker_end_s")
_IDX = {name: i for i, name in enumerate(FIELDS)}


def _put_time(out: torch.Tensor, prefix: str, t: float | None) -> None:
    if t is None or t <= 0:
        return  # all zero: not reported
    whole = int(t)
    out[_IDX[f"{prefix}_hi"]] = whole >> 16
    out[_IDX[f"{prefix}_lo"]] = whole & 0xFFFF
    out[_IDX[f"{prefix}_frac"]] = t - whole


def _get_time(head: list[float], prefix: str) -> float | None:
    hi, lo, frac = (head[_IDX[f"{prefix}_{k}"]] for k in ("hi", "lo", "frac"))
    return None if hi == lo == frac == 0.0 else (int(hi) << 16) + int(lo) + frac


def encode(frame_index: int, codes: torch.Tensor | None, timings: dict[str, float], batch_rows: int,
           scheduled_tokens: int, step: int, hidden: torch.Tensor | None = None,
           nonfinite: bool = False) -> torch.Tensor:
    """One row's record; ``pid``/``tid`` are this (worker) process and thread."""
    n_hidden = 0 if hidden is None else hidden.numel()
    out = torch.zeros(HEADER + n_hidden, dtype=torch.float32)
    out[0] = -1.0 if nonfinite else 1.0 if codes is not None else 0.0
    out[1] = frame_index
    if codes is not None:
        out[_CODES] = codes.to(torch.float32)
    for name in _MS_FIELDS:
        out[_IDX[name]] = float(timings.get(name, 0.0))
    _put_time(out, "start", timings.get("worker_start_s"))
    _put_time(out, "end", timings.get("worker_end_s"))
    out[_IDX["batch_rows"]] = batch_rows
    out[_IDX["scheduled_tokens"]] = scheduled_tokens
    out[_IDX["step"]] = step
    out[_IDX["pid"]] = os.getpid()
    out[_IDX["tid"]] = threading.get_native_id()
    out[_IDX["hidden_size"]] = n_hidden
    if hidden is not None:
        out[HEADER:] = hidden.reshape(-1).to(torch.float32)
    return out


def decode(t: torch.Tensor) -> dict[str, Any]:
    """-> ``{"codes": LongTensor [16] | None, "nonfinite", "frame_index", timings..., "hidden": [H] | None, ...}``."""
    t = torch.as_tensor(t).reshape(-1)
    head = t[:HEADER].tolist()
    d: dict[str, Any] = {name: head[i] for i, name in enumerate(FIELDS) if not _CODES.start <= i < _CODES.stop}
    d["frame_index"] = int(head[1])
    d["codes"] = t[_CODES].to(torch.int64) if head[0] > 0.5 else None
    d["nonfinite"] = head[0] < -0.5
    n_hidden = int(head[_IDX["hidden_size"]])
    d["hidden"] = t[HEADER:HEADER + n_hidden].clone() if n_hidden else None
    for name in ("batch_rows", "scheduled_tokens", "step", "pid", "tid"):
        d[name] = int(d[name])
    d["worker_start_s"], d["worker_end_s"] = _get_time(head, "start"), _get_time(head, "end")
    return d


# ---- request data: PromptRequest + SamplingParams <-> msgpack-native dict (SamplingParams.extra_args) ----
EXTRA_KEY = "omnilab"


def request_to_extra(req, params, seed: int) -> dict[str, Any]:
    """``PromptRequest`` + ``omnilab.sampling.SamplingParams`` -> plain dict (ints, floats, lists)."""
    import dataclasses

    def ids(v):
        return None if v is None else [int(i) for i in v]

    return {
        "text_ids": ids(req.text_ids), "speaker": req.speaker, "language": req.language,
        "instruct_ids": ids(req.instruct_ids),
        "x_vector": None if req.x_vector is None else req.x_vector.reshape(-1).float().tolist(),
        "ref_codes": None if req.ref_codes is None else req.ref_codes.to(torch.int64).tolist(),
        "ref_text_ids": ids(req.ref_text_ids), "non_streaming_mode": req.non_streaming_mode,
        "params": {k: v for k, v in dataclasses.asdict(params).items()}, "seed": int(seed),
    }


def extra_to_request(d: dict[str, Any], dtype: torch.dtype):
    """Inverse of :func:`request_to_extra` -> ``(PromptRequest, SamplingParams, seed)``."""
    req = PromptRequest(
        text_ids=list(d["text_ids"]), speaker=d["speaker"], language=d["language"],
        instruct_ids=d["instruct_ids"],
        x_vector=None if d["x_vector"] is None else torch.tensor(d["x_vector"], dtype=torch.float32).to(dtype),
        ref_codes=None if d["ref_codes"] is None else torch.tensor(d["ref_codes"], dtype=torch.int64),
        ref_text_ids=d["ref_text_ids"], non_streaming_mode=d["non_streaming_mode"])
    return req, SamplingParams(**d["params"]), int(d["seed"])
