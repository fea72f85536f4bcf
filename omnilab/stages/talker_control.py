"""What ``Pipeline`` does on its owner thread: step-wise control, routed requests, stream ends, closing.

Contract (docs/reliability.md#threads-and-iterators):
- ``TalkerControl`` is ``pipe.talker``: ``start`` / ``step`` / ``abort`` run on the pipeline's owner thread
  (:class:`omnilab.stages.owner.OwnerThread`). Step-wise requests are driven by one thread: while some are
  live, ``start`` and ``step`` from another thread raise ``InputError`` naming the safe calls
  (``generate``/``stream``). ``abort`` works from any thread; a ``stream()`` of that request ends at its next
  iteration. ``step()`` returns the step-wise requests' outputs; it advances live streams too (their frames go to
  their iterators).
- ``OwnedRequests`` (a mixin of ``Pipeline``; it holds no state of its own): ``generate()``/``stream()`` requests
  are routed (``FrameRouter``), refused while step-wise requests are live (and ``talker.start`` while streams are);
  ``_pump`` is their talker step and raises once the pipeline is closed or the caller interrupted;
  ``pipe.code2wav`` is an ``OwnedProxy``.

May import: the standard library, ``omnilab.errors`` and ``omnilab.stages.owner``.
"""
from __future__ import annotations

import threading
from typing import Any, Hashable

from omnilab.errors import InputError
from omnilab.stages.owner import Cancelled, OwnedProxy


class TalkerControl:
    """Step-wise access to the talker stage: ``start`` requests, then ``step`` one frame at a time."""

    def __init__(self, pipe: Any):
        self._pipe = pipe

    def start(self, text: str | None = None, *, request_id: Hashable | None = None, **kwargs) -> Hashable:
        """Validate and queue one request; it is prefilled by the next :meth:`step`. Returns its id.
        Takes the same keyword arguments as ``Pipeline.generate`` (one utterance). While step-wise requests
        are live, only the thread that started them may start or step more (docs/reliability.md)."""
        return self._pipe._owner.run(self._pipe._start_stepwise, text, kwargs, request_id, threading.get_ident())

    def step(self, return_hidden: bool = False) -> dict[Hashable, Any]:
        """Advance every live request by one frame -> ``{request_id: FrameOutput}`` of the step-wise requests
        (codes ``[16]``, ``hidden [H]`` when ``return_hidden``, per-phase timings in ms, finish flags)."""
        return self._pipe._owner.run(self._pipe._step_stepwise, return_hidden, threading.get_ident())

    def abort(self, request_id: Hashable) -> None:
        """End a request from any thread (a ``stream()`` of it ends at its next iteration)."""
        self._pipe._owner.run(self._pipe._abort, request_id)

    @property
    def num_live(self) -> int:
        return self._pipe._talker.num_live

    def has_unfinished(self) -> bool:
        return self._pipe._talker.has_unfinished()

    def __repr__(self) -> str:
        return f"TalkerControl(backend={self._pipe.backend!r}, live={self.num_live})"


class OwnedRequests:
    """``Pipeline``'s owner-thread side (see the module docstring); it uses the pipeline's attributes."""

    @property
    def code2wav(self):
        """The code2wav stage (``decode``, ``open_session``); its methods run on the pipeline's owner thread."""
        return self._code2wav

    @code2wav.setter
    def code2wav(self, stage) -> None:
        self._code2wav = OwnedProxy(getattr(stage, "_obj", stage), self._owner)

    def _start_routed(self, text, kw: dict[str, Any], request_id: Hashable | None = None):
        """``_start`` for generate()/stream(): the request's outputs are queued for it (``FrameRouter``)."""
        self._check_open()
        self._check_idle()
        if request_id is not None and (request_id in self._requests or request_id in self._router):
            raise InputError(f"request_id {request_id!r} is already live; give each request its own id")
        rid, preq = self._start(text, kw, request_id)
        self._router.add(rid)
        return rid, preq

    def _start_stepwise(self, text, kw: dict[str, Any], request_id: Hashable | None, caller: int) -> Hashable:
        self._check_driver(caller)
        if self._router:
            raise InputError(f"{len(self._router)} stream() iterator(s) are live; pipe.talker.start() cannot share the "
                             "talker with them: finish or close them first, or use pipe.stream()/pipe.generate()")
        rid = self._start(text, kw, request_id, auto_end=True)[0]
        self._stepwise[rid] = caller
        return rid

    def _check_driver(self, caller: int) -> None:
        self._check_open()
        if self._stepwise and caller not in self._stepwise.values():
            raise InputError(f"pipe.talker is driven by another thread ({len(self._stepwise)} step-wise request(s) "
                             "live): start and step them from that one thread, or call pipe.generate()/pipe.stream(), "
                             "which are safe from any thread")

    def _step_stepwise(self, return_hidden: bool, caller: int) -> dict[Hashable, Any]:
        self._check_driver(caller)
        outs = self._router.route(self._step(return_hidden))  # stream() frames go to their iterators
        for o in outs:
            if o.finished:
                self._stepwise.pop(o.request_id, None)
                self._requests.pop(o.request_id, None)
        return {o.request_id: o for o in outs}

    def _abort(self, request_id: Hashable) -> None:
        out = self._talker.abort(request_id)
        self._requests.pop(request_id, None)
        self._stepwise.pop(request_id, None)
        self._router.end(request_id, out)  # a stream() of it ends at its next iteration
        self.recorder.end(request_id, "abort")

    def cancel(self, request_id: Hashable) -> None:
        """End a request from any thread without waiting for the owner thread: it is aborted before the next
        talker step of any generate()/stream() loop (a frame at most), its stream ends at its next iteration."""
        with self._cancel_lock:
            self._cancelled.add(request_id)

    def _abort_cancelled(self) -> None:
        with self._cancel_lock:
            ids, self._cancelled = self._cancelled, set()
        for rid in ids:
            if rid in self._requests:
                self._abort(rid)

    def _pump(self, return_hidden: bool = False) -> list:
        """One talker step of a generate()/stream() loop; stops here when the pipeline was closed or the caller
        was interrupted (the loop aborts its requests). Requests cancelled from other threads end first."""
        if self._closed:
            raise InputError("this Pipeline was closed while the request was running")
        if self._owner.cancelled():
            raise Cancelled("the caller was interrupted")
        if self._cancelled:
            self._abort_cancelled()
        return self._step(return_hidden)

    def _check_idle(self) -> None:
        if self._stepwise:
            raise InputError("step-wise talker requests (pipe.talker.start) are still live; finish them with "
                             "pipe.talker.step() or pipe.talker.abort(request_id) before generate()/stream()")

    def _stream_end(self, st: dict) -> None:
        """On the owner thread, once: abort the request unless it finished, free its decoder state."""
        if st.get("ended"):
            return
        st["ended"], rid = True, st["rid"]
        try:
            if not st["finished"] and not self._closed:
                self._talker.abort(rid)
            if st.get("session") is not None:
                st["session"].close()
        finally:
            self._requests.pop(rid, None)
            self._router.drop(rid)
            self.recorder.end(rid, st["reason"] if st["finished"] else "abort")
            if "session" in st:
                self.hooks.stop()

    def _close_stages(self) -> None:
        self._router.end_all()
        self._talker.close()
        self.code2wav.close()
        self._requests.clear()
        self._stepwise.clear()
