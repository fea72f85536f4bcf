"""The pipeline's side of instrumentation: ``Recorder`` stamps spans and hands them to the hooks.

Contract: spans carry ``perf_counter`` times, process CPU time (``time.process_time``: every thread of
the process), pid and native thread id. The recorder keeps each live request's spans; ``end`` emits the
``request`` span and returns the request's ``Trace`` (with the hooks' thread samples over its lifetime).
Work done in stage worker processes arrives as span dicts (``FrameOutput.spans``, or a stage/session
``take_spans()`` the pipeline calls) and is forwarded unchanged, so a trace shows every process. A
``FrameOutput`` with ``worker_pid``/``worker_tid`` (another process) puts its phase spans on that process's
track with the durations it reported, from when the worker began the step (``worker_start_s``, on the
host's one monotonic clock) and inside the worker's step window (not nested in the client's ``step``
span: a pipelined worker computes ahead of the client).
Thread-safe. No torch, no plotting.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import time
from typing import Any, Hashable, Iterable, Iterator

from omnilab.instrument.hooks import Hooks
from omnilab.instrument.trace import SPAN_STAGES, Span, Trace


class _Open:
    __slots__ = ("start_s", "spans", "auto_end", "frames", "audio_ms", "attrs")

    def __init__(self, start_s: float, auto_end: bool, attrs: dict):
        self.start_s, self.auto_end, self.attrs = start_s, auto_end, attrs
        self.spans: list[Span] = []
        self.frames, self.audio_ms = 0, 0.0


def clock() -> tuple[float, float]:
    """(``perf_counter`` s, process CPU s): the start stamp ``Recorder`` methods take."""
    return time.perf_counter(), time.process_time()


class Recorder:
    """Stamps spans for a pipeline and forwards them to its hooks. Thread-safe.

    Typical use inside the pipeline: ``t = clock(); ...work...; rec.span("hop", rid, t)``."""

    def __init__(self, hooks: Hooks | None = None, meta: dict | None = None):
        if hooks is None:
            hooks = Hooks()
        self.hooks = hooks
        self.meta = dict(meta or {})
        self.pid = os.getpid()
        self._ids = itertools.count(1)
        self._open: dict[str, _Open] = {}
        self._worker_end: dict[tuple[int, int], float] = {}  # last reported phase end per worker thread
        self._lock = threading.Lock()

    clock = staticmethod(clock)

    def _emit(self, span: Span) -> Span:
        with self._lock:
            span.span_id = next(self._ids)
            o = self._open.get(span.request_id)
            if o is not None:
                o.spans.append(span)
        self.hooks.on_span(span)
        return span

    def span(self, name: str, request_id: Hashable, start: tuple[float, float | None], end_s: float | None = None,
             *, stage: str | None = None, frame_index: int = -1, num_frames: int = 0, parent_id: int = -1,
             **attrs) -> Span:
        """Emit a span that began at ``start`` (from :func:`clock`) and ends at ``end_s`` (default now)."""
        t1 = time.perf_counter() if end_s is None else end_s
        cpu = 1e3 * (time.process_time() - start[1]) if start[1] is not None and end_s is None else math.nan
        return self._emit(Span(name, stage or SPAN_STAGES.get(name, "client"), str(request_id), start[0], t1,
                               self.pid, threading.get_native_id(), frame_index, num_frames, cpu,
                               parent_id=parent_id, attrs=attrs))

    @contextlib.contextmanager
    def timed(self, name: str, request_id: Hashable, **kw) -> Iterator[None]:
        t = clock()
        yield
        self.span(name, request_id, t, **kw)

    def begin(self, request_id: Hashable, start: tuple[float, float], *, auto_end: bool = False, **attrs) -> None:
        """A request was admitted (validated, queued); ``start`` is when admission began. With
        ``auto_end`` the request ends with its last talker frame (step-wise use)."""
        rid = str(request_id)
        with self._lock:
            self._open[rid] = _Open(start[0], auto_end, attrs)
        self.span("admission", rid, start)

    def keep_open(self, request_id: Hashable) -> None:
        """Do not end this request at its last talker frame; the caller will call :meth:`end`."""
        o = self._open.get(str(request_id))
        if o is not None:
            o.auto_end = False

    def is_open(self, request_id: Hashable) -> bool:
        return str(request_id) in self._open

    def step(self, outputs: Iterable[Any], start: tuple[float, float]) -> None:
        """Spans for one talker step that began at ``start``: per request a ``step`` span with its
        phases laid out in engine order (prefill, code predictor, input prep, talker forward, then the
        rest of the step as ``sampling``), from the ``*_ms`` fields a ``FrameOutput`` reports (the stage contract
        of :mod:`omnilab.stages.base`: every field is there, so none is probed). Phases another process ran
        go on its track, where it ran them (:meth:`_worker_phases`)."""
        t1 = time.perf_counter()
        cpu = 1e3 * (time.process_time() - start[1])
        outputs = list(outputs)
        local = [o for o in outputs if (o.worker_pid or self.pid) == self.pid]
        cursor = start[0]
        prefill_at: dict[str, tuple[float, float]] = {}
        for o in local:  # prefills run one after another at the start of the step
            p = float(o.prefill_ms or 0.0)
            if p > 0:
                end = min(cursor + p / 1e3, t1)
                prefill_at[str(o.request_id)] = (cursor, end)
                cursor = end
        phases, shared = [], cursor
        for ph, attr in (("code_predictor", "predictor_ms"), ("input_prep", "input_prep_ms"),
                         ("talker_forward", "talker_ms")):
            ms = float(getattr(local[0], attr) or 0.0) if local else 0.0  # a *_ms field
            if ms > 0:
                end = min(shared + ms / 1e3, t1)
                phases.append((ph, shared, end, {}))
                shared = end
        reported = float(local[0].sampling_ms or 0.0) if local else 0.0
        if phases and reported > 0:
            phases.append(("sampling", shared, t1, {"reported_ms": round(reported, 3)}))
        tid = threading.get_native_id()
        # a worker step cannot have begun before every request it ran was admitted
        admitted = max((o_.start_s for o_ in (self._open.get(str(o.request_id)) for o in outputs) if o_ is not None),
                       default=-math.inf)
        worker_layout: dict = {"admitted": admitted}
        for o in outputs:
            rid = str(o.request_id)
            has_frame = o.codes is not None
            s = self._emit(Span("step", "talker", rid, start[0], t1, self.pid, tid, int(o.frame_index),
                                int(has_frame), cpu, attrs={"batch": len(outputs)}))
            # phases ran where the backend says (``worker_pid``/``worker_tid``), else in this thread
            wpid, wtid = o.worker_pid or self.pid, o.worker_tid or tid
            if wpid != self.pid:
                self._worker_phases(o, rid, wpid, wtid, t1, worker_layout, has_frame)
            else:
                if rid in prefill_at:
                    a, b = prefill_at[rid]
                    self._emit(Span("prefill", "talker", rid, a, b, wpid, wtid, 0, 0, parent_id=s.span_id))
                for ph, a, b, attrs in phases if has_frame else ():
                    self._emit(Span(ph, "talker", rid, a, b, wpid, wtid, int(o.frame_index), 0,
                                    parent_id=s.span_id, attrs=dict(attrs)))
            self.remote(o.spans or (), parent_id=s.span_id)
            o_open = self._open.get(rid)
            if o_open is not None:
                o_open.frames += int(has_frame)
                if o.finished and o_open.auto_end:
                    self.end(rid, o.finish_reason or "", end_s=t1)

    _WORKER_ORDER = (("input_prep", "input_prep_ms"), ("talker_forward", "talker_ms"),
                     ("code_predictor", "predictor_ms"), ("sampling", "sampling_ms"))

    def _worker_phases(self, o: Any, rid: str, pid: int, tid: int, t_received: float, layout: dict,
                       has_frame: bool) -> None:
        """Phases a worker process reported, on its track, one after another (input prep, talker forward,
        code predictor, sampling) from when the worker began the step (``worker_start_s``, its
        ``perf_counter``: the host's one monotonic clock) and clipped to the step's window: never past
        ``worker_end_s`` nor past ``t_received``, when the client had the frame, and never before the
        worker's previous step ended or its requests were admitted. Without ``worker_start_s`` they end
        at ``t_received``. A prefill is the talker forward of the step that admitted the request: it
        starts with that phase. Batched rows of one worker step share one layout (``attrs.reported_ms``:
        a phase the window clipped)."""
        key = (pid, tid, o.worker_start_s)
        if key not in layout:
            ms = [(ph, float(getattr(o, attr) or 0.0)) for ph, attr in self._WORKER_ORDER]
            end = t_received if o.worker_end_s is None else min(float(o.worker_end_s), t_received)
            t = t_received - sum(m for _, m in ms) / 1e3 if o.worker_start_s is None else float(o.worker_start_s)
            t = min(max(t, self._worker_end.get((pid, tid), -math.inf), layout["admitted"]), end)
            placed = []
            for ph, m in ms:
                b = min(t + m / 1e3, end)
                if m > 0:
                    placed.append((ph, t, b, m))
                t = b
            self._worker_end[(pid, tid)] = t
            layout[key] = (placed, end)
        placed, end = layout[key]
        p = float(o.prefill_ms or 0.0)
        if p > 0:
            a = next((a for ph, a, _, _ in placed if ph == "talker_forward"), placed[0][1] if placed else end)
            self._emit(Span("prefill", "talker", rid, a, min(a + p / 1e3, end), pid, tid, 0, 0,
                            attrs={"worker": True}))
        for ph, a, b, m in placed if has_frame else ():
            attrs = {"worker": True} if b - a >= m / 1e3 - 1e-9 else {"worker": True, "reported_ms": round(m, 3)}
            self._emit(Span(ph, "talker", rid, a, b, pid, tid, int(o.frame_index), 0, attrs=attrs))

    def remote(self, spans: Iterable[Any], parent_id: int = -1) -> None:
        """Forward spans recorded elsewhere (dicts or ``Span``s with their own pid/tid, e.g. from
        ``omnilab.instrument.trace.SpanBuffer`` in a worker). They keep their own nesting; ``reported_in`` names the
        local span that carried them."""
        for d in spans:
            s = d if isinstance(d, Span) else Span.from_dict(d)
            s.attrs = {**s.attrs, "remote": True, "reported_in": parent_id}
            self._emit(s)

    def deliver(self, request_id: Hashable, frame_start: int, frame_end: int, num_samples: int,
                sample_rate: int = 24000) -> Span:
        """An audio chunk reached the caller (an instant)."""
        t = time.perf_counter()
        o = self._open.get(str(request_id))
        audio_ms = 1e3 * num_samples / sample_rate
        if o is not None:
            o.audio_ms += audio_ms
        return self.span("deliver", request_id, (t, None), t, frame_index=frame_start,
                         num_frames=frame_end - frame_start, audio_ms=audio_ms)

    def end(self, request_id: Hashable, finish_reason: str = "", end_s: float | None = None, **attrs) -> Trace | None:
        """Close a request: emit its ``request`` span and return its ``Trace`` (spans + samples of the
        hooks over its lifetime). None if the request is not open."""
        rid = str(request_id)
        with self._lock:
            o = self._open.pop(rid, None)
        if o is None:
            return None
        t1 = time.perf_counter() if end_s is None else end_s
        req = Span("request", "client", rid, o.start_s, t1, self.pid, threading.get_native_id(),
                   0, o.frames, span_id=next(self._ids),
                   attrs={**o.attrs, **attrs, "frames": o.frames, "audio_ms": o.audio_ms,
                          "finish_reason": finish_reason})
        for s in o.spans:
            if s.parent_id < 0 and s.name != "request":
                s.parent_id = req.span_id if s.pid == self.pid else -1
        self.hooks.on_span(req)
        extra = self.hooks.collect(o.start_s, t1 + 0.1)
        trace = Trace(o.spans + [req], extra.get("thread_samples", ()), extra.get("core_samples", ()),
                      extra.get("process_samples", ()), self.meta)
        self.hooks.on_request_end(trace)
        return trace

    def __repr__(self) -> str:
        return f"Recorder(open={len(self._open)}, hooks={self.hooks!r})"
