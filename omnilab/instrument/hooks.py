"""Instrumentation hooks: the pipeline reports spans; hooks collect, sample threads, show progress.

Contract:
- ``Hook`` is the protocol (a base class with no-op methods): ``attach(pipeline)`` once when given to a
  pipeline, ``start()``/``stop()`` around every synthesis (re-entrant: nested runs count),
  ``on_span(span)`` for every finished span, ``on_request_end(trace)`` with the request's ``Trace``, and
  ``collect(t0_s, t1_s) -> {"spans"|"thread_samples"|"core_samples"|"process_samples": rows}``. Hooks
  compose with ``Hooks(a, b, ...)``; ``as_hooks`` accepts None, a hook, a callable ``fn(span)`` or a list.
  A pipeline's ``pipe.hooks`` takes more later: ``pipe.hooks.add(h)`` or ``with pipe.hooks.using(h):``.
- ``TimingHook`` keeps every span; ``ThreadUsageHook`` samples per-thread / per-core CPU time of the
  pipeline's processes (``omnilab.instrument.sampler``); ``ProgressHook`` shows a ``tqdm.auto`` bar of frames.
- ``Recorder`` (``omnilab.instrument.recorder``) is the pipeline's side that emits the spans.
  No plotting here.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

from omnilab.instrument.progress import bar
from omnilab.instrument.sampler import ThreadSampler
from omnilab.instrument.trace import PHASES, Span, Trace

_SAMPLE_KEYS = ("spans", "thread_samples", "core_samples", "process_samples")


class Hook:
    """Base hook: override what you need. Called on the thread that drives the pipeline."""

    def attach(self, pipeline: Any) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def on_span(self, span: Span) -> None:
        pass

    def on_request_end(self, trace: Trace) -> None:
        pass

    def collect(self, t0_s: float | None = None, t1_s: float | None = None) -> dict[str, list]:
        return {}

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class FunctionHook(Hook):
    """Wraps ``fn(span)``: called for every finished span."""

    def __init__(self, fn: Callable[[Span], Any]):
        self.fn = fn

    def on_span(self, span: Span) -> None:
        self.fn(span)

    def __repr__(self) -> str:
        return f"FunctionHook({getattr(self.fn, '__name__', self.fn)!r})"


class Hooks(Hook):
    """Several hooks as one, called in order. ``running()`` scopes ``start``/``stop``."""

    def __init__(self, *hooks: Hook):
        self.hooks = [as_hook(h) for h in hooks]
        self._pipeline = None

    def attach(self, pipeline):
        self._pipeline = pipeline
        for h in self.hooks:
            h.attach(pipeline)

    def add(self, hook: Any) -> Hook:
        """Add a hook (attached to the pipeline these hooks serve, if any); returns it."""
        h = as_hook(hook)
        self.hooks.append(h)
        if self._pipeline is not None:
            h.attach(self._pipeline)
        return h

    def remove(self, hook: Hook) -> None:
        self.hooks = [h for h in self.hooks if h is not hook]

    @contextlib.contextmanager
    def using(self, *hooks: Any) -> Iterator[list[Hook]]:
        """Add hooks for the duration of a ``with`` block: ``with pipe.hooks.using(TimingHook()) as (t,):``."""
        added = [self.add(h) for h in hooks]
        try:
            yield added
        finally:
            for h in added:
                self.remove(h)

    def start(self):
        for h in self.hooks:
            h.start()

    def stop(self):
        for h in reversed(self.hooks):
            h.stop()

    def on_span(self, span):
        for h in self.hooks:
            h.on_span(span)

    def on_request_end(self, trace):
        for h in self.hooks:
            h.on_request_end(trace)

    def collect(self, t0_s=None, t1_s=None):
        out: dict[str, list] = {}
        for h in self.hooks:
            for k, rows in h.collect(t0_s, t1_s).items():
                out.setdefault(k, []).extend(rows)
        return out

    @contextlib.contextmanager
    def running(self) -> Iterator["Hooks"]:
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def trace(self, t0_s: float | None = None, t1_s: float | None = None, meta: dict | None = None) -> Trace:
        """A ``Trace`` of everything the hooks collected (spans from ``TimingHook``, samples from
        ``ThreadUsageHook``), optionally limited to ``[t0_s, t1_s]``."""
        d = self.collect(t0_s, t1_s)
        return Trace(d.get("spans", ()), d.get("thread_samples", ()), d.get("core_samples", ()),
                     d.get("process_samples", ()), meta)

    def find(self, kind: type) -> Any:
        """The first hook of type ``kind`` (searching nested ``Hooks``), or None."""
        for h in self.hooks:
            if isinstance(h, kind):
                return h
            if isinstance(h, Hooks) and (f := h.find(kind)) is not None:
                return f
        return None

    def __len__(self) -> int:
        return len(self.hooks)

    def __repr__(self) -> str:
        return f"Hooks({', '.join(map(repr, self.hooks))})"


def as_hook(h: Any) -> Hook:
    if isinstance(h, Hook):
        return h
    if callable(h):
        return FunctionHook(h)
    raise TypeError(f"a hook must be an omnilab.instrument.hooks.Hook or a callable fn(span); got {type(h).__name__}")


def as_hooks(h: Any) -> Hooks:
    """None -> empty ``Hooks``; a ``Hooks`` as is; a hook/callable or a list of them -> ``Hooks``."""
    if h is None:
        return Hooks()
    if isinstance(h, Hooks):
        return h
    if isinstance(h, (list, tuple)):
        return Hooks(*h)
    return Hooks(h)


class TimingHook(Hook):
    """Keeps every span it sees (all requests); ``trace()`` / ``collect()`` hand them out."""

    def __init__(self):
        self.spans: list[Span] = []
        self.traces: list[Trace] = []  # one per finished request
        self._lock = threading.Lock()

    def on_span(self, span: Span) -> None:
        with self._lock:
            self.spans.append(span)

    def on_request_end(self, trace: Trace) -> None:
        self.traces.append(trace)

    def collect(self, t0_s=None, t1_s=None):
        with self._lock:
            spans = [s for s in self.spans if (t0_s is None or s.start_s >= t0_s) and (t1_s is None or s.end_s <= t1_s)]
        return {"spans": spans}

    def trace(self) -> Trace:
        return Trace(self.collect()["spans"])

    def reset(self) -> None:
        with self._lock:
            self.spans.clear()
            self.traces.clear()

    def __repr__(self) -> str:
        return f"TimingHook(spans={len(self.spans)}, requests={len(self.traces)})"


class ThreadUsageHook(Hook):
    """Samples CPU time per thread and per core while a synthesis runs (see ``omnilab.instrument.sampler``).

    Args:
        interval_s: sampling period (default 50 ms). Sampling runs between ``start`` and ``stop``
            (the pipeline calls them around every ``generate``/``stream``; ``with hook:`` does too).
        processes: extra ``{pid: role}`` to sample; the attached pipeline adds its own and its workers'.
        cores: also sample machine-wide per-core utilisation (``/proc/stat``).
    """

    def __init__(self, interval_s: float = 0.05, processes: dict[int, str] | None = None, cores: bool = True):
        self.sampler = ThreadSampler(interval_s=interval_s, cores=cores)
        for pid, role in (processes or {}).items():
            self.sampler.add_process(pid, role)
        self._pipeline = None
        self._depth = 0
        self._lock = threading.Lock()

    def attach(self, pipeline) -> None:
        self._pipeline = pipeline
        self._refresh()

    def _refresh(self) -> None:
        procs = getattr(self._pipeline, "processes", None)
        if procs is not None:
            for pid, role in procs().items():
                self.sampler.add_process(pid, role)

    def add_process(self, pid: int, role: str) -> None:
        self.sampler.add_process(pid, role)

    def start(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._refresh()
                self.sampler.start()

    def stop(self) -> None:
        with self._lock:
            self._depth = max(self._depth - 1, 0)
            if self._depth == 0:
                self.sampler.stop()

    def collect(self, t0_s=None, t1_s=None):
        if t1_s is not None and self.sampler.running:
            # a request ends here: close the open interval so a request shorter than the period (which
            # stretches to 10x on a busy machine, see the sampler) still gets the rows of its threads
            self.sampler.sample_once()
        return self.sampler.rows(t0_s, t1_s)

    def overhead(self) -> dict[str, float]:
        """The sampler's own CPU cost: ``sampler_cpu_ms``, ``samples``, ``ms_per_sample``,
        ``active_ms`` (wall time sampled) and ``cpu_fraction`` = sampler CPU / active wall."""
        return self.sampler.overhead()

    def trace(self) -> Trace:
        d = self.collect()
        return Trace((), d["thread_samples"], d["core_samples"], d["process_samples"])

    def reset(self) -> None:
        self.sampler.clear()

    def __repr__(self) -> str:
        return f"ThreadUsageHook(interval={self.sampler.interval_s * 1e3:.0f} ms, rows={self.sampler.num_rows})"


class ProgressHook(Hook):
    """A ``tqdm.auto`` progress bar of talker frames (and frames/s) while a synthesis runs:
    ``Pipeline.from_pretrained(..., hooks=ProgressHook(total=max_new_tokens))`` (``omnilab synth`` attaches one).
    ``progress``: True / False, or None for ``omnilab.instrument.progress.progress_enabled``'s rule
    (``OMNILAB_PROGRESS``, the verbosity, a terminal or a notebook)."""

    def __init__(self, desc: str = "frames", total: int | None = None, progress: bool | None = None):
        self.desc, self.total, self.progress, self.bar = desc, total, progress, None

    def start(self) -> None:
        if self.bar is None:
            self.bar = bar(total=self.total, desc=self.desc, unit="frame", progress=self.progress)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_span(self, span: Span) -> None:
        if self.bar is not None and span.name == "step" and span.num_frames:
            self.bar.update(span.num_frames)


__all__ = ["Hook", "Hooks", "FunctionHook", "TimingHook", "ThreadUsageHook", "ProgressHook", "as_hooks", "as_hook",
           "PHASES"]
