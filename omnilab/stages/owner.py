"""One thread owns a pipeline's stages; talker outputs are routed to the request that waits for them.

Contract (docs/reliability.md#threads-and-iterators):
- ``OwnerThread()``: one daemon thread that runs every call on the stages (engine, ZeroMQ sockets, worker pipes,
  decoder state). ``run(fn, *args)`` runs ``fn`` there and returns its result (or raises its exception) in the
  calling thread; on the owner thread itself it calls ``fn`` directly (re-entrant). Calls from several threads
  run one at a time, in arrival order, except that ``run_first`` calls (a stream's start and its calls until its
  first chunk) go ahead of the queued ordinary ones, so a new request's first audio does not wait for the chunks
  other streams have queued. A caller interrupted while it waits (``KeyboardInterrupt``) cancels its
  call: a call not started yet is skipped, a running one sees :meth:`OwnerThread.cancelled` turn True (the
  pipeline checks it before every talker step); cleanup (``run_if_open``, ``run_later``) is never skipped.
  ``stop()`` lets the running call finish, refuses new ones with ``InputError(closed_message)`` and ends the
  thread; it never waits on itself.
- ``OwnedProxy(obj, owner)``: ``obj``'s methods run on the owner thread (attributes read and written as they
  are); ``open_session`` results are proxied too. ``pipe.code2wav`` is one.
- ``FrameRouter``: one queue of ``FrameOutput`` per request that ``generate``/``stream`` run. Every talker step
  fills the queues of all such requests, so a request's frames never reach another's loop (several streams
  interleave). ``end(rid)`` queues an ``"abort"`` output (``pipe.talker.abort``), so a loop waiting on that
  request ends; ``pull`` raises ``WorkerError`` rather than step forever when the talker has no request left.
- ``OwnedIterator(owner, step, end, first)``: each ``next`` runs ``step()`` on the owner thread -> ``(item, last)``,
  with ``run_first`` while ``first()`` is True;
  ``(None, True)`` ends the iteration, ``(AGAIN, False)`` hands the owner thread to a waiting call and runs
  ``step()`` again after it (streams that share the thread take turns a talker step at a time). ``close()`` (also
  at garbage collection, and after an error or the last item) runs ``end()`` once; after the owner stopped (the
  pipeline was closed) it does nothing.

May import: the standard library, ``omnilab.errors``, ``omnilab.stages.base`` and ``omnilab.stages.omp_pool`` (a
caller releases its OpenMP pool before it hands a call over: see that module).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import queue
import threading
from typing import Any, Callable, Hashable, Iterable

from omnilab.errors import InputError, WorkerError
from omnilab.stages.base import FrameOutput
from omnilab.stages.omp_pool import release_caller_pool

_POLL_S = 0.25  # how often a waiting caller checks that the owner thread still runs


class Cancelled(Exception):
    """Raised on the owner thread inside a call whose caller was interrupted (its requests are aborted)."""


class _Call:
    __slots__ = ("fn", "args", "kwargs", "done", "result", "error", "cancelled", "cancellable")

    def __init__(self, fn, args, kwargs, cancellable: bool = True):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = threading.Event()
        self.result = self.error = None
        self.cancelled = False
        self.cancellable = cancellable  # False: cleanup, run even when its caller was interrupted


class OwnerThread:
    def __init__(self, name: str = "omnilab-owner",
                 closed_message: str = "this Pipeline is closed; create a new one with Pipeline.from_pretrained"):
        self.closed_message = closed_message
        self._queue: queue.PriorityQueue = queue.PriorityQueue()  # (priority, arrival, call); None ends the loop
        self._arrival = itertools.count()
        self._current: _Call | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def is_owner(self) -> bool:
        return threading.current_thread() is self._thread  # not the ident: a later thread may reuse it

    @property
    def alive(self) -> bool:
        return not self._stopped and self._thread.is_alive()

    def contended(self) -> bool:
        """True while another call waits in the queue: a long call (a stream stepping the talker until its chunk
        is due) hands the thread over between talker steps, so a new request starts within one step."""
        return not self._queue.empty()

    def cancelled(self) -> bool:
        """True on the owner thread while it runs a call whose caller stopped waiting (interrupted)."""
        c = self._current
        return c is not None and c.cancelled and c.cancellable and self.is_owner

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the owner thread; its result or its exception here."""
        return self._run(_Call(fn, args, kwargs))

    def run_first(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`run`, but ahead of the ordinary calls already queued (after the running one and the
        ``run_first`` calls queued before it)."""
        return self._run(_Call(fn, args, kwargs), priority=0)

    def _put(self, call: _Call | None, priority: int) -> None:
        self._queue.put((priority, next(self._arrival), call))

    def _run(self, call: _Call, priority: int = 1) -> Any:
        if self.is_owner:
            return call.fn(*call.args, **call.kwargs)
        if not self.alive:
            raise InputError(self.closed_message)
        release_caller_pool()  # the owner computes now: the caller's idle OpenMP workers would throttle its pool
        self._put(call, priority)
        try:
            while not call.done.wait(_POLL_S):
                if not self._thread.is_alive():
                    raise InputError(self.closed_message)
        except BaseException:
            call.cancelled = True  # interrupted: skip it if not started; the running call checks cancelled()
            raise
        if call.error is not None:
            raise call.error
        return call.result

    def run_if_open(self, fn: Callable, *args: Any) -> Any:
        """Like :meth:`run`, but does nothing (None) once the owner stopped; not skipped when interrupted (cleanup)."""
        try:
            return self._run(_Call(fn, args, {}, cancellable=False))
        except InputError:
            if self.alive:
                raise
            return None

    def run_later(self, fn: Callable, *args: Any) -> None:
        """Queue ``fn(*args)`` without waiting (cleanup asked for on the owner thread in the middle of a call)."""
        if self.alive:
            self._put(_Call(fn, args, {}, cancellable=False), 1)

    def _loop(self) -> None:
        while True:
            call = self._queue.get()[2]
            if call is None:
                return
            if not (call.cancelled and call.cancellable):
                self._current = call
                try:
                    call.result = call.fn(*call.args, **call.kwargs)
                except BaseException as e:  # handed to the caller; the owner thread lives on
                    call.error = e
                finally:
                    self._current = None
                    release_caller_pool()  # and back: no idle pool here throttles the caller or another pipeline's owner
            call.done.set()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Refuse new calls, let the queued and running ones finish, end the thread. Idempotent."""
        if not self._stopped:
            self._stopped = True
            self._put(None, 2)  # after every queued call
        if not self.is_owner and self._thread.is_alive():
            self._thread.join(timeout_s)


class OwnedProxy:
    """``obj`` whose methods run on ``owner``'s thread; attribute reads and writes go to ``obj``."""
    __slots__ = ("_obj", "_owner")

    def __init__(self, obj: Any, owner: OwnerThread):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_owner", owner)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._obj, name)
        if not inspect.ismethod(value):
            return value
        owner = self._owner

        @functools.wraps(value)
        def call(*args, **kwargs):
            out = owner.run(value, *args, **kwargs)
            return OwnedProxy(out, owner) if name == "open_session" else out
        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._obj, name, value)

    def __repr__(self) -> str:
        return repr(self._obj)


class FrameRouter:
    def __init__(self):
        self._queues: dict[Hashable, collections.deque] = {}

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._queues

    def __len__(self) -> int:
        return len(self._queues)

    def add(self, rid: Hashable) -> None:
        self._queues[rid] = collections.deque()

    def drop(self, rid: Hashable) -> None:
        self._queues.pop(rid, None)

    def route(self, outs: Iterable[FrameOutput]) -> list[FrameOutput]:
        """Queue the outputs of routed requests; return the others (step-wise requests)."""
        rest = []
        for o in outs:
            q = self._queues.get(o.request_id)
            (rest if q is None else q).append(o)
        return rest

    def end(self, rid: Hashable, out: FrameOutput | None = None) -> None:
        """Queue the request's last output (``"abort"`` unless given), so whatever waits on it ends."""
        q = self._queues.get(rid)
        if q is not None:
            q.append(out if out is not None else FrameOutput(rid, 0, None, True, "abort", 0))

    def end_all(self) -> None:
        for rid in list(self._queues):
            self.end(rid)

    def pull(self, rids: Iterable[Hashable], step: Callable[[], Any], has_unfinished: Callable[[], bool],
             max_steps: int | None = None) -> dict[Hashable, list[FrameOutput]]:
        """Every queued output of ``rids``; when there is none, ``step()`` the talker (its outputs routed) until
        there is, or ``max_steps`` steps were taken (then the lists may be empty). ``WorkerError`` when the talker
        has nothing left to run and none came."""
        rids = list(rids)
        gone = {r: [FrameOutput(r, 0, None, True, "abort", 0)] for r in rids if r not in self._queues}
        rids = [r for r in rids if r not in gone]
        steps = 0
        while rids and not any(self._queues[r] for r in rids) and (max_steps is None or steps < max_steps):
            if not has_unfinished():
                raise WorkerError(f"request(s) {rids} are no longer in the talker stage and ended without a last "
                                  "output")
            self.route(step())
            steps += 1
        out = gone
        for r in rids:
            q = self._queues[r]
            out[r], _ = list(q), q.clear()
        return out


AGAIN = object()  # OwnedIterator step: no item yet, call again (another caller was let in first)


class OwnedIterator:
    """Iterator whose items are made on the owner thread (see the module docstring)."""

    def __init__(self, owner: OwnerThread, step: Callable[[], tuple[Any, bool]], end: Callable[[], None],
                 first: Callable[[], bool] = lambda: False):
        self._owner, self._step, self._end, self._first = owner, step, end, first
        self._finished = self._ended = False

    def __iter__(self) -> "OwnedIterator":
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        try:
            item = AGAIN
            while item is AGAIN:  # ``first()``: no item yet delivered, so ahead of the queued ordinary calls
                item, last = (self._owner.run_first if self._first() else self._owner.run)(self._step)
        except BaseException:
            self._finished = True
            self.close()
            raise
        if last:
            self._finished = True
            self.close()
            if item is None:
                raise StopIteration
        return item

    def close(self) -> None:
        """Stop early: abort the request and free its state (on the owner thread). Idempotent."""
        self._finished = True
        if self._ended:
            return
        self._ended = True
        if self._owner.is_owner and self._owner._current is not None:
            self._owner.run_later(self._end)  # in the middle of another call (e.g. garbage collection): after it
        else:
            self._owner.run_if_open(self._end)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()
