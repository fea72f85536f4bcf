"""Spans, traces, latency metrics and exporters: plain data (numpy/pandas), no torch, no plotting.

Contract:
- A ``Span`` is one timed piece of work: ``name`` (see ``SPAN_STAGES``), ``stage``, ``request_id``, the
  process/thread that did it, ``start_s``/``end_s`` on ``time.perf_counter()`` (CLOCK_MONOTONIC on
  Linux, one clock for every process of the host, so spans reported by stage worker processes line up),
  ``cpu_ms`` (CPU time of the whole process over the span, every thread; NaN when unknown), the frames it
  covers and a parent span. Zero-length spans are instants (``deliver``).
- A ``Trace`` holds spans plus thread/core/process samples (``omnilab.instrument.hooks.ThreadUsageHook``) and meta.
  ``metrics()`` derives per-request latency figures (definitions in ``request_metrics``); ``check()``
  lists broken invariants; ``to_pandas`` / ``to_csv`` / ``to_parquet`` (with ``meta``; ``read_tables`` reads
  them back) / ``to_perfetto`` export.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from omnilab.html_tables import key_value_table
from omnilab.instrument.export import chrome_trace_events
from omnilab.instrument.tables import read_trace, write_trace

# span name -> stage it belongs to. "step" wraps one talker step (its prefill and phases are children).
SPAN_STAGES = {
    "request": "client", "admission": "client", "hop": "client", "deliver": "client", "consumer": "client",
    "step": "talker", "prefill": "talker", "code_predictor": "talker", "input_prep": "talker",
    "talker_forward": "talker", "sampling": "talker", "code2wav_chunk": "code2wav",
}
PHASES = ("prefill", "code_predictor", "input_prep", "talker_forward", "sampling")
SPAN_COLUMNS = ("span_id", "parent_id", "request_id", "stage", "name", "pid", "tid", "frame_index",
                "num_frames", "start_s", "end_s", "start_ms", "duration_ms", "cpu_ms", "attrs")
_EPS_S = 1e-6


@dataclass(slots=True)
class Span:
    """One timed piece of work. Times are ``perf_counter`` seconds; ``cpu_ms`` is process CPU time."""
    name: str
    stage: str
    request_id: str
    start_s: float
    end_s: float
    pid: int
    tid: int
    frame_index: int = -1          # first frame covered (-1: not frame-bound)
    num_frames: int = 0            # frames produced/decoded by this span (step: 1, chunk: F)
    cpu_ms: float = math.nan
    span_id: int = 0
    parent_id: int = -1
    attrs: dict = field(default_factory=dict)

    @property
    def duration_ms(self) -> float:
        return 1e3 * (self.end_s - self.start_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Span":
        keys = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in keys})


class SpanBuffer:
    """Worker-side recorder for stage processes: ``with buf.span("code2wav_chunk", rid, frame_index=f,
    num_frames=n): ...`` then ``buf.take()`` -> span dicts (this pid and thread) to send to the client,
    which forwards them to its hooks (``Recorder.remote``). Cheap: two clock reads per span."""

    def __init__(self):
        self._spans: list[dict[str, Any]] = []

    def add(self, name: str, request_id: Any, start_s: float, end_s: float, cpu_ms: float = math.nan,
            **kw) -> None:
        import threading

        stage = kw.pop("stage", SPAN_STAGES.get(name, "client"))
        self._spans.append(Span(name, stage, str(request_id), start_s, end_s, os.getpid(),
                                threading.get_native_id(), cpu_ms=cpu_ms, **kw).to_dict())

    def span(self, name: str, request_id: Any, **kw):
        import contextlib
        import time

        @contextlib.contextmanager
        def timed():
            t, c = time.perf_counter(), time.process_time()
            yield
            self.add(name, request_id, t, time.perf_counter(), 1e3 * (time.process_time() - c), **kw)
        return timed()

    def take(self) -> list[dict[str, Any]]:
        out, self._spans = self._spans, []
        return out


# ---- metric definitions ------------------------------------------------------------------------
def playback_start_ms(arrival_ms: Sequence[float], chunk_audio_ms: Sequence[float]) -> float:
    """Earliest playback start that never runs dry: ``max_i(arrival_i - sum_{j<i} audio_j)``.

    ``arrival_i`` is when chunk i was delivered (ms after admission), ``audio_j`` the audio duration of
    chunk j (ms). A player that starts then plays through without a pause (vLLM-Omni stream bench:
    "max over chunks of arrival time minus audio already buffered"). Equals TTFA when chunks keep up."""
    if len(arrival_ms) == 0:
        return math.nan
    buffered = np.concatenate([[0.0], np.cumsum(np.asarray(chunk_audio_ms, float))[:-1]])
    return float(np.max(np.asarray(arrival_ms, float) - buffered))


def stall_ms(arrival_ms: Sequence[float], chunk_audio_ms: Sequence[float]) -> float:
    """Stall at TTFA = playback-start latency - TTFA: the total pause a player that starts at the first
    chunk and waits whenever its buffer is empty accumulates (0 when generation keeps ahead)."""
    if len(arrival_ms) == 0:
        return math.nan
    return playback_start_ms(arrival_ms, chunk_audio_ms) - float(arrival_ms[0])


def rtf(wall_s: float, audio_s: float) -> float:
    """Real-time factor = wall time / audio duration (lower is better, < 1 is faster than real time)."""
    return wall_s / audio_s if audio_s > 0 else math.inf


def x_realtime(wall_s: float, audio_s: float) -> float:
    """x-realtime = audio duration / wall time (higher is better, > 1 is faster than real time)."""
    return audio_s / wall_s if wall_s > 0 else math.inf


def percentiles(values: Iterable[float], qs: Sequence[float] = (50, 90, 95, 99)) -> dict[str, float]:
    v = np.asarray(list(values), float)
    return {f"p{q:g}": (float(np.percentile(v, q)) if len(v) else math.nan) for q in qs}


def _remote(s: Span) -> bool:
    """A span a worker process reported (detail of a client-side span, not counted twice)."""
    return bool(s.attrs.get("remote"))


def request_metrics(spans: Sequence[Span], request_id: str) -> dict[str, Any]:
    """Latency figures of one request from its spans (times in ms after its admission began):

    - ``ttfa_ms``: time to first audio = first ``deliver`` - ``request`` start (for ``generate`` the only
      delivery is the whole utterance, so TTFA is time to full audio).
    - ``playback_start_ms`` / ``stall_ms``: see :func:`playback_start_ms` and :func:`stall_ms`.
    - ``wall_ms``: ``request`` span (admission to last delivery); ``audio_ms``: delivered audio.
    - ``rtf`` = wall/audio, ``x_realtime`` = audio/wall (see :func:`rtf`, :func:`x_realtime`).
    - ``frames``: frames produced by talker steps; ``frames_per_s`` = frames / wall.
    - ``<stage>_ms_per_frame``: summed wall time of the stage's top-level spans (talker ``step``,
      ``code2wav_chunk``) / frames; ``<phase>_ms_per_frame`` likewise per talker phase. Batched steps are
      shared, so each request of a batch is charged the full step it waited for. ``talker_ms_per_frame``
      is what the client waited; ``talker_compute_ms_per_frame`` sums the phases (for a worker process
      that computes ahead of the client, the time it reported; in-process, the same as the step);
      ``code2wav_compute_ms_per_frame`` likewise from the chunk spans a code2wav worker reported.
    - ``step_ms_p50/p90/p99``: talker step wall time; ``prefill_ms``: the prefill phase.
    """
    rid = str(request_id)
    own = [s for s in spans if s.request_id == rid]
    req = [s for s in own if s.name == "request"]
    t0 = req[0].start_s if req else min((s.start_s for s in own), default=0.0)
    deliver = sorted((s for s in own if s.name == "deliver"), key=lambda s: s.start_s)
    arrival = [1e3 * (s.start_s - t0) for s in deliver]
    audio = [float(s.attrs.get("audio_ms", 80.0 * s.num_frames)) for s in deliver]
    steps = [s for s in own if s.name == "step" and not _remote(s)]
    frames = sum(s.num_frames for s in steps)
    wall_ms = req[0].duration_ms if req else (1e3 * (max(s.end_s for s in own) - t0) if own else math.nan)
    audio_ms = float(sum(audio))
    out: dict[str, Any] = {
        "request_id": rid, "frames": frames, "audio_ms": audio_ms, "wall_ms": wall_ms,
        "ttfa_ms": arrival[0] if arrival else math.nan,
        "playback_start_ms": playback_start_ms(arrival, audio), "stall_ms": stall_ms(arrival, audio),
        "rtf": rtf(wall_ms, audio_ms), "x_realtime": x_realtime(wall_ms, audio_ms),
        "frames_per_s": 1e3 * frames / wall_ms if wall_ms and wall_ms > 0 else math.nan,
        "num_chunks": len(deliver),
        "finish_reason": req[0].attrs.get("finish_reason", "") if req else "",
    }
    n = max(frames, 1)
    for stage, name in (("talker", "step"), ("code2wav", "code2wav_chunk")):  # as the client saw them
        out[f"{stage}_ms_per_frame"] = sum(s.duration_ms for s in own if s.name == name and not _remote(s)) / n
    worker_c2w = sum(s.duration_ms for s in own if s.name == "code2wav_chunk" and _remote(s))
    out["code2wav_compute_ms_per_frame"] = worker_c2w / n if worker_c2w else out["code2wav_ms_per_frame"]
    for ph in PHASES:
        out[f"{ph}_ms_per_frame"] = sum(s.duration_ms for s in own if s.name == ph) / n
    phase_ms = sum(s.duration_ms for s in own if s.name in PHASES)
    out["talker_compute_ms_per_frame"] = phase_ms / n if phase_ms else out["talker_ms_per_frame"]
    out["prefill_ms"] = sum(s.duration_ms for s in own if s.name == "prefill")
    pct = percentiles([s.duration_ms for s in steps], (50, 90, 99))
    out.update({f"step_ms_{k}": v for k, v in pct.items()})
    return out


# ---- the trace ---------------------------------------------------------------------------------
class Trace:
    """Spans of one or more requests, plus thread/core/process samples taken while they ran.

    Sample rows (dicts) are documented in ``omnilab.instrument.hooks.ThreadUsageHook``. ``meta`` holds run facts
    (backend, dtype, threads, pids)."""

    def __init__(self, spans: Iterable[Span] = (), thread_samples: Iterable[dict] = (),
                 core_samples: Iterable[dict] = (), process_samples: Iterable[dict] = (),
                 meta: dict | None = None):
        self.spans = sorted(spans, key=lambda s: (s.start_s, s.span_id))
        self.thread_samples = list(thread_samples)
        self.core_samples = list(core_samples)
        self.process_samples = list(process_samples)
        self.meta = dict(meta or {})

    # ---- views ---------------------------------------------------------------------------------
    @property
    def t0_s(self) -> float:
        """Earliest span start (or sample time): the zero of ``start_ms`` columns and plots."""
        starts = [s.start_s for s in self.spans] + [r["t_s"] - r.get("interval_ms", 0) / 1e3
                                                     for r in self.thread_samples + self.core_samples]
        return min(starts) if starts else 0.0

    @property
    def request_ids(self) -> list[str]:
        seen: dict[str, None] = {}
        for s in self.spans:
            if s.request_id:
                seen.setdefault(s.request_id)
        return list(seen)

    def window_s(self) -> tuple[float, float]:
        if not self.spans:
            return (0.0, 0.0)
        return min(s.start_s for s in self.spans), max(s.end_s for s in self.spans)

    def for_request(self, request_id: str) -> "Trace":
        """This request's spans and the samples taken during its lifetime."""
        own = [s for s in self.spans if s.request_id == str(request_id)]
        t = Trace(own, meta=self.meta)
        t0, t1 = t.window_s()
        pick = lambda rows: [r for r in rows if t0 <= r["t_s"] <= t1 + 0.1]  # noqa: E731
        t.thread_samples, t.core_samples = pick(self.thread_samples), pick(self.core_samples)
        t.process_samples = pick(self.process_samples)
        return t

    def merge(self, other: "Trace") -> "Trace":
        return Trace(self.spans + other.spans, self.thread_samples + other.thread_samples,
                     self.core_samples + other.core_samples, self.process_samples + other.process_samples,
                     {**self.meta, **other.meta})

    def metrics(self):
        """One row per request (pandas DataFrame); columns defined in :func:`request_metrics`."""
        import pandas as pd

        return pd.DataFrame([request_metrics(self.spans, r) for r in self.request_ids])

    def request_metrics(self, request_id: str | None = None) -> dict[str, Any]:
        ids = self.request_ids
        return request_metrics(self.spans, str(request_id) if request_id is not None else ids[0])

    # ---- invariants ----------------------------------------------------------------------------
    def check(self) -> list[str]:
        """Broken invariants, as messages (empty = consistent): spans end after they start, children sit
        inside their parent, every span of a request lies inside its ``request`` span, talker steps do
        not overlap and count frames 0, 1, 2..., code2wav chunks cover consecutive frames, and the
        ``request`` span's ``frames`` equals the frames of its steps."""
        bad: list[str] = []
        by_id = {s.span_id: s for s in self.spans}
        for s in self.spans:
            if s.end_s < s.start_s - _EPS_S:
                bad.append(f"span {s.span_id} {s.name} ends before it starts")
            p = by_id.get(s.parent_id)
            if p is not None and (s.start_s < p.start_s - _EPS_S or s.end_s > p.end_s + _EPS_S):
                bad.append(f"span {s.span_id} {s.name} sticks out of parent {p.span_id} {p.name}")
        for rid in self.request_ids:
            own = [s for s in self.spans if s.request_id == rid]
            req = [s for s in own if s.name == "request"]
            if len(req) != 1:
                bad.append(f"{rid}: {len(req)} request spans")
                continue
            r = req[0]
            for s in own:
                if s.start_s < r.start_s - _EPS_S or s.end_s > r.end_s + _EPS_S:
                    bad.append(f"{rid}: {s.name} span {s.span_id} outside the request span")
            steps = sorted((s for s in own if s.name == "step" and not _remote(s)), key=lambda s: s.start_s)
            for a, b in zip(steps, steps[1:]):
                if b.start_s < a.end_s - _EPS_S:
                    bad.append(f"{rid}: steps {a.span_id} and {b.span_id} overlap")
            idx = [s.frame_index for s in steps if s.num_frames]
            if idx != list(range(len(idx))):
                bad.append(f"{rid}: step frame indices {idx[:8]}... are not 0, 1, 2, ...")
            if "frames" in r.attrs and r.attrs["frames"] != len(idx):
                bad.append(f"{rid}: request says {r.attrs['frames']} frames, steps produced {len(idx)}")
            pos = 0
            chunks = (s for s in own if s.name == "code2wav_chunk" and not _remote(s))
            for c in sorted(chunks, key=lambda s: s.start_s):
                if c.frame_index != pos:
                    bad.append(f"{rid}: code2wav chunk starts at frame {c.frame_index}, expected {pos}")
                pos = c.frame_index + c.num_frames
        return bad

    # ---- tables --------------------------------------------------------------------------------
    def to_pandas(self, kind: str = "spans"):
        """``kind="spans"``: one row per span (``SPAN_COLUMNS``; ``start_ms`` is relative to ``t0_s``,
        ``attrs`` a JSON string). ``"threads"`` / ``"cores"`` / ``"processes"``: the sample rows."""
        import pandas as pd

        if kind != "spans":
            rows = {"threads": self.thread_samples, "cores": self.core_samples,
                    "processes": self.process_samples}.get(kind)
            if rows is None:
                raise ValueError(f"kind {kind!r}; accepted: spans, threads, cores, processes")
            df = pd.DataFrame(rows)
            if len(df) and "t_s" in df:
                df.insert(1, "t_ms", 1e3 * (df["t_s"] - self.t0_s))
            return df
        t0 = self.t0_s
        data = {c: [] for c in SPAN_COLUMNS}
        for s in self.spans:
            for c in SPAN_COLUMNS:
                if c == "start_ms":
                    v = 1e3 * (s.start_s - t0)
                elif c == "duration_ms":
                    v = s.duration_ms
                elif c == "attrs":
                    v = json.dumps(s.attrs, default=str, sort_keys=True)
                else:
                    v = getattr(s, c)
                data[c].append(v)
        df = pd.DataFrame(data)
        ints = ("span_id", "parent_id", "pid", "tid", "frame_index", "num_frames")
        return df.astype({**{c: "int64" for c in ints},
                          **{c: "float64" for c in ("start_s", "end_s", "start_ms", "duration_ms", "cpu_ms")}})

    def threads_to_pandas(self):
        """Thread samples, one row per (sample, thread); see ``ThreadUsageHook``."""
        return self.to_pandas("threads")

    def to_csv(self, directory: str | os.PathLike, prefix: str = "trace") -> list[Path]:
        """Write ``<prefix>_spans.csv`` and, when sampled, ``_threads/_cores/_processes.csv``; each starts with
        ``# key: <json>`` lines of ``meta`` (``omnilab.instrument.tables``; :meth:`read_tables` reads them back)."""
        return write_trace(self, directory, prefix, "csv")

    def to_parquet(self, directory: str | os.PathLike, prefix: str = "trace") -> list[Path]:
        """Same files as :meth:`to_csv` in Parquet, ``meta`` under the schema metadata key ``omnilab`` (needs
        ``pyarrow``)."""
        return write_trace(self, directory, prefix, "parquet")

    @classmethod
    def read_tables(cls, directory: str | os.PathLike, prefix: str = "trace") -> "Trace":
        """The trace :meth:`to_csv` or :meth:`to_parquet` wrote, with its ``meta``."""
        return cls.from_dict(read_trace(directory, prefix))

    def to_dict(self) -> dict[str, Any]:
        return {"spans": [s.to_dict() for s in self.spans], "thread_samples": self.thread_samples,
                "core_samples": self.core_samples, "process_samples": self.process_samples, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trace":
        return cls([Span.from_dict(s) for s in d.get("spans", [])], d.get("thread_samples", ()),
                   d.get("core_samples", ()), d.get("process_samples", ()), d.get("meta"))

    # ---- Perfetto / chrome://tracing -------------------------------------------------------------
    def to_chrome_trace(self) -> dict[str, Any]:
        """Trace Event JSON: one track per process/thread (``M`` name events), spans as ``X`` complete
        events (a batched step shared by several requests appears once, with all request ids),
        ``deliver`` as instants, each request as an async ``b``/``e`` track, thread CPU and per-core
        utilisation as ``C`` counters. ``ts``/``dur`` in microseconds since ``t0_s``, whole nanoseconds, ``dur``
        from the rounded end; on a track complete events nest or do not touch (rules: ``instrument.export``)."""
        return {"traceEvents": chrome_trace_events(self), "displayTimeUnit": "ms",
                "otherData": {k: str(v) for k, v in self.meta.items()}}

    def to_perfetto(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_chrome_trace` as JSON; open it at https://ui.perfetto.dev."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_chrome_trace()))
        return p

    # ---- notebook ------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        t0, t1 = self.window_s()
        pids = sorted({s.pid for s in self.spans} | {r["pid"] for r in self.thread_samples})
        return {"requests": len(self.request_ids), "spans": len(self.spans),
                "window_ms": round(1e3 * (t1 - t0), 1), "processes": pids,
                "thread_samples": len(self.thread_samples), "core_samples": len(self.core_samples)}

    def __repr__(self) -> str:
        s = self.summary()
        return (f"Trace(requests={s['requests']}, spans={s['spans']}, window={s['window_ms']:.0f} ms, "
                f"thread_samples={s['thread_samples']})")

    def _repr_html_(self) -> str:
        body = ""
        if self.request_ids:
            cols = ["request_id", "frames", "ttfa_ms", "playback_start_ms", "stall_ms", "rtf", "x_realtime",
                    "talker_ms_per_frame", "code2wav_ms_per_frame"]
            body = self.metrics()[cols].round(2).to_html(index=False, border=0)
        return f"<div><b>Trace</b>{key_value_table(self.summary())}{body}</div>"
