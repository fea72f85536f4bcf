"""The stage contract: what every talker stage and code2wav stage offers the pipeline, and what a step returns.

Contract:
- ``FrameOutput``: one request's result of one talker step (codes ``[16]`` or None, finish state, seed, the
  step's phase times in ms, and where the step ran: ``worker_pid``/``worker_tid`` for a worker process, with
  ``worker_start_s``/``worker_end_s`` on that worker's clock, the host's CLOCK_MONOTONIC).
- ``TalkerStage`` and ``Code2WavStageProtocol`` (typing Protocols) list the methods the pipeline calls; the
  eager, vLLM in-process and worker stages implement all of them (in-process stages report no processes and
  no remote spans), so the pipeline never probes a stage with ``getattr``.
- ``DEFAULT_MAX_NEW_TOKENS_LIMIT``: the released models' ``max_new_tokens`` cap (generation_config.json).

May import: the standard library and torch types only (every stage imports this module, it imports no stage).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Protocol, runtime_checkable

import torch

DEFAULT_MAX_NEW_TOKENS_LIMIT = 8192  # generation_config.json of the released models


@dataclass
class FrameOutput:
    request_id: Hashable
    frame_index: int                 # 0-based frame number (for codes None: frames produced so far)
    codes: torch.Tensor | None       # [16] int64, codebooks 0..15
    finished: bool
    finish_reason: str | None        # "eos" | "length" | "abort" | None
    seed: int
    hidden: torch.Tensor | None = None  # [H] talker hidden that produced c0 (return_hidden=True)
    # Wall time of this step's phases (shared by all rows of a batched step), in ms.
    prefill_ms: float = 0.0          # this request's prefill (first step only)
    input_prep_ms: float = 0.0
    talker_ms: float = 0.0
    predictor_ms: float = 0.0
    sampling_ms: float = 0.0         # talker + sub-talker sampling (sub-talker part is inside predictor_ms)
    worker_pid: int | None = None    # process and thread that ran the step (None: this thread)
    worker_tid: int | None = None
    # When that worker began and ended this step, on its perf_counter (CLOCK_MONOTONIC: the client's clock
    # too); None: not reported (the recorder then lays the phases out to end when the client received them).
    worker_start_s: float | None = None
    worker_end_s: float | None = None
    spans: tuple = ()                # span dicts a worker reports with this frame (omnilab.instrument)


@runtime_checkable
class TalkerStage(Protocol):
    """A talker stage: requests in, one ``FrameOutput`` per live request per ``step`` out."""
    backend: str
    max_new_tokens_limit: int

    def add_request(self, request_id: Hashable, req: Any, params: Any) -> int: ...
    def step(self, return_hidden: bool = False) -> list[FrameOutput]: ...
    def abort(self, request_id: Hashable) -> FrameOutput | None: ...
    def has_unfinished(self) -> bool: ...
    def processes(self) -> dict[int, str]: ...          # {pid: role} of worker processes ({} in-process)
    def take_spans(self) -> list[dict[str, Any]]: ...   # spans worker processes recorded since the last call
    def summary(self) -> dict[str, Any]: ...            # pid, threads, ... of where the stage runs
    def close(self) -> None: ...


@runtime_checkable
class Code2WavStageProtocol(Protocol):
    """A code2wav stage: whole-utterance ``decode`` and per-request streaming sessions."""
    def decode(self, codes: Any, prefix_codes: Any = None) -> Any: ...
    def open_session(self, request_id: Hashable, prefix_codes: Any = None) -> Any: ...
    def processes(self) -> dict[int, str]: ...
    def take_spans(self) -> list[dict[str, Any]]: ...
    def info(self) -> dict[str, Any]: ...               # pid, torch_threads, ... (what check_profile reads)
    def close(self) -> None: ...
