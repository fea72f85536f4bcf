"""The server's one ``Pipeline``: admission (a slot per generating request, a bounded wait queue), streams run in
worker threads, cancellation on disconnect, and restart after an engine death.

Every request is a ``Pipeline.stream`` (a non-streamed answer gathers the chunks), so concurrent requests share the
talker's batch: each ``next()`` steps every live request (vLLM's continuous batching on the vLLM backend)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from omnilab.errors import InputError, OmnilabError, WorkerError
from omnilab.serve.config import ServeConfig
from omnilab.serve.metrics import ServeMetrics
from omnilab.serve.speech import ApiError, SpeechRequest

log = logging.getLogger("omnilab.serve")
_DONE = object()


@dataclass
class RequestStats:
    """One request's figures: what the usage and timing headers and the metrics report."""
    request_id: str
    t0: float = field(default_factory=time.perf_counter)
    ttfa_ms: float | None = None
    frames: int = 0
    samples: int = 0
    text_tokens: int = 0
    audio_tokens: int = 0
    finish_reason: str = ""

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def audio_s(self) -> float:
        return self.samples / 24000.0

    @property
    def rtf(self) -> float | None:
        return self.wall_s / self.audio_s if self.samples else None

    def usage(self) -> dict[str, Any]:
        inp = self.text_tokens + self.audio_tokens
        return {"input_tokens": inp, "output_tokens": self.frames, "total_tokens": inp + self.frames,
                "input_token_details": {"text_tokens": self.text_tokens, "audio_tokens": self.audio_tokens}}

    def headers(self) -> dict[str, str]:
        u = self.usage()
        h = {"x-vllm-omni-input-tokens": str(u["input_tokens"]), "x-vllm-omni-output-tokens": str(self.frames),
             "x-vllm-omni-total-tokens": str(u["total_tokens"]),
             "x-vllm-omni-input-text-tokens": str(self.text_tokens),
             "x-vllm-omni-input-audio-tokens": str(self.audio_tokens),
             "x-request-id": self.request_id, "x-omnilab-audio-duration-s": f"{self.audio_s:.3f}",
             "x-omnilab-wall-s": f"{self.wall_s:.3f}"}
        if self.ttfa_ms is not None:
            h["x-omnilab-ttfa-ms"] = f"{self.ttfa_ms:.1f}"
        if self.rtf is not None:
            h["x-omnilab-rtf"] = f"{self.rtf:.3f}"
        return h


class Stream:
    """One admitted request: ``await next_chunk()`` -> ``AudioChunk`` or None at the end; ``cancel()`` from any
    thread ends it in the engine within a talker step; ``close()`` frees its slot (idempotent)."""

    def __init__(self, engine: "Engine", iterator, stats: RequestStats):
        self.engine, self.iterator, self.stats = engine, iterator, stats
        self.cancelled = False
        self.closed = False

    async def next_chunk(self):
        try:
            chunk = await anyio.to_thread.run_sync(next, self.iterator, _DONE)
        except WorkerError as e:
            self.engine.engine_died(e)
            raise ApiError(503, f"the engine died while generating ({e}); the server is restarting it, "
                                f"retry shortly") from None
        except InputError as e:
            raise ApiError(400, str(e)) from None
        if chunk is _DONE:
            return None
        st = self.stats
        if st.ttfa_ms is None:
            st.ttfa_ms = st.wall_s * 1e3
            self.engine.metrics.ttfa.labels(self.engine.model_name).observe(st.ttfa_ms / 1e3)
        n = chunk.frame_end - chunk.frame_start
        st.frames += n
        st.samples += len(chunk.audio)
        self.engine.metrics.add_frames(n)
        return chunk

    def cancel(self) -> None:
        """The client went away: end the request in the engine now (KV cache, decoder state)."""
        if not self.cancelled and not self.closed:
            self.cancelled = True
            self.engine.pipe.cancel(self.stats.request_id)

    async def close(self, status: str) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await anyio.to_thread.run_sync(self._close_iterator)
        finally:
            self.engine.release(self, status)

    def _close_iterator(self) -> None:
        try:
            self.iterator.close()
        except OmnilabError:  # the pipeline was closed or restarted under it: nothing left to free
            pass


class Engine:
    """Holds the pipeline; ``state`` is starting | ready | restarting | failed | closed."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.pipe = None
        self.state = "starting"
        self.error: str | None = None
        self.model_type = ""
        self.model_name = config.served_model_name or (config.model or "omnilab-tiny")
        self.speakers: list[str] = []
        self.languages: list[str] = []
        self.metrics = ServeMetrics(self.model_name)
        self._ids = itertools.count()
        self._running = 0
        self._waiting = 0
        self._slots: asyncio.Semaphore | None = None
        self._live: set[Stream] = set()
        self._restart_lock = threading.Lock()
        self._restarter: threading.Thread | None = None

    # ---- lifetime ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Build the pipeline (blocking: tens of seconds for vLLM on a small machine)."""
        from omnilab.pipeline import Pipeline  # lazy: torch

        c = self.config
        profile = None if (c.deploy_profile or "").lower() == "none" else c.deploy_profile
        self.pipe = Pipeline.from_pretrained(c.model, backend=c.backend, deploy_profile=profile, deploy=c.deploy,
                                             quantization=c.quantization, dtype=c.dtype, num_threads=c.threads,
                                             max_concurrency=c.max_concurrency if profile is not None else None)
        cfg = self.pipe.model.config
        self.model_type = cfg.tts_model_type
        self.speakers = list(cfg.speakers) if self.model_type == "custom_voice" else []
        self.languages = list(cfg.languages)
        self.state = "ready"

    def close(self, restart_wait_s: float = 300.0) -> None:
        """Close the pipeline (its workers exit with it), after a restart in progress has ended."""
        if self._restarter is not None:
            self._restarter.join(timeout=restart_wait_s)
        self.state = "closed"
        if self.pipe is not None:
            self.pipe.close()

    def engine_died(self, err: Exception) -> None:
        """A ``WorkerError``: answer 503 until ``pipe.restart()`` (run once, in a thread) has built new workers."""
        with self._restart_lock:
            if self.state != "ready":
                return
            self.state, self.error = "restarting", str(err)
        log.warning("engine died (%s); restarting the pipeline", err)
        self.metrics.restarts.labels(self.model_name).inc()
        self._restarter = threading.Thread(target=self._restart, name="omnilab-serve-restart", daemon=True)
        self._restarter.start()

    def _restart(self) -> None:
        try:
            self.pipe.restart()
        except Exception as e:  # reported on /health; a new start is the operator's call
            log.error("restart failed: %s", e)
            self.state, self.error = "failed", f"restart failed: {e}"
            return
        self.state, self.error = "ready", None
        log.warning("pipeline restarted")

    def check_ready(self) -> None:
        if self.state != "ready":
            why = {"starting": "the model is loading", "restarting": f"the engine is restarting after: {self.error}",
                   "failed": self.error, "closed": "the server is shutting down"}.get(self.state, self.state)
            raise ApiError(503, f"not ready: {why}; retry shortly")

    # ---- admission --------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return self._waiting

    async def open(self, req: SpeechRequest, status_on_error: list | None = None) -> Stream:
        """Wait for a slot (429 when the queue is full) and start the request's stream (400 on a bad field)."""
        self.check_ready()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_concurrency)
        if self._slots.locked() and self._waiting >= self.config.max_queue:
            raise ApiError(429, f"{self._running} requests are generating and {self._waiting} waiting, the most this "
                                f"server takes (--max-concurrency {self.config.max_concurrency}, --max-queue "
                                f"{self.config.max_queue}); retry later")
        self._waiting += 1
        self._gauges()
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        self._gauges()
        rid = f"speech-{next(self._ids)}"
        stats = RequestStats(rid)
        try:
            self.check_ready()
            it = await anyio.to_thread.run_sync(self.start_stream, req, rid)
        except BaseException:
            self._running -= 1
            self._slots.release()
            self._gauges()
            raise
        stream = Stream(self, it, stats)
        stats.text_tokens, stats.audio_tokens = self._token_counts(req, rid)
        self._live.add(stream)
        return stream

    def start_stream(self, req: SpeechRequest, rid: str):
        """``pipe.stream`` of a parsed request (blocking; in a worker thread): the server's one way in, also what
        ``omnilab bench --serve`` times in-process beside the server."""
        from omnilab.models.code2wav_stream import ChunkSchedule  # lazy: torch

        sched = None
        if req.initial_chunk_frames is not None:
            base = self.pipe.chunk_schedule
            sched = ChunkSchedule(req.initial_chunk_frames, base.ramp, base.steady_frames)
        try:
            return self.pipe.stream(req.text, chunk_schedule=sched, request_id=rid, **req.kwargs)
        except WorkerError as e:
            self.engine_died(e)
            raise ApiError(503, f"the engine is dead ({e}); the server is restarting it, retry shortly") from None
        except OmnilabError as e:  # InputError, UnsupportedError, ...: the pipeline's own message
            raise api_input_error(e) from None

    def _token_counts(self, req: SpeechRequest, rid: str) -> tuple[int, int]:
        """(text tokens of input + instructions, reference codec frames of ICL cloning), as vLLM-Omni counts."""
        tok = self.pipe.model.tokenizer
        n = len(tok.encode(req.text.strip()))
        if isinstance(req.kwargs.get("instruct"), str) and req.kwargs["instruct"].strip():
            n += len(tok.encode(req.kwargs["instruct"].strip()))
        ref = (self.pipe._requests.get(rid) or {}).get("ref_codes")
        return n, (0 if ref is None else int(len(ref)))

    def release(self, stream: Stream, status: str) -> None:
        if stream in self._live:
            self._live.discard(stream)
            self._running -= 1
            self._slots.release()
            self._gauges()
        self.metrics.count(status)
        st = stream.stats
        if status == "ok":
            self.metrics.e2e.labels(self.model_name).observe(st.wall_s)
            if st.rtf is not None:
                self.metrics.rtf.labels(self.model_name).observe(st.rtf)
            self.metrics.audio_s.labels(self.model_name).inc(st.audio_s)

    def _gauges(self) -> None:
        self.metrics.running.labels(self.model_name).set(self._running)
        self.metrics.waiting.labels(self.model_name).set(self._waiting)

    def live_streams(self) -> list[Stream]:
        return list(self._live)


PIPELINE_TO_API = {"text": "input", "speaker": "voice", "instruct": "instructions"}


def api_input_error(e: Exception) -> ApiError:
    """The pipeline's message, led by the HTTP field it is about where the pipeline's name differs."""
    msg = str(e)
    first = msg.split(" ", 1)[0].rstrip(":")
    api = PIPELINE_TO_API.get(first)
    return ApiError(400, f"{api}: {msg}" if api else msg, api or (first if first.isidentifier() else None))


def concat(chunks: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, dtype=np.float32)
