"""Is the vLLM engine alive, and if not, why: the engine-core and talker worker processes seen from the client.

Contract (used by :class:`~omnilab.stages.vllm.engine.VllmTalkerStage`):
- ``engine_processes(engine_core)`` -> the engine-core ``multiprocessing`` processes (``[]`` in-process);
  ``engine_alive(engine_core)``: vLLM has not marked it dead and every engine-core process lives.
- ``death_cause(engine_core, worker_pids)`` (one pid, or one per tensor-parallel rank) -> names every process that
  exited and how (exit code or signal),
  or None when every process still lives (the engine core then failed inside a step).
- ``is_dead_error(e)``: ``e`` is vLLM's ``EngineDeadError``.
- ``timed_rpc(engine_core, method, args, timeout_s, alive)``: ``collective_rpc`` through the multiprocess client
  with a client-side deadline (vLLM's own client waits for the answer without one): ``TimeoutError`` after
  ``timeout_s``, :class:`~omnilab.errors.WorkerError` as soon as ``alive()`` is False.
- ``wait_for_output(engine_core, timeout_s, alive)``: a step's outputs, or why none came (``"dead"``/``"timeout"``).
- ``renice(engine, nice)``: lower the engine core's priority.
- ``shutdown(engine_core)``: stop it, quietly, and reap its processes: none is left running or as a zombie.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
import uuid
from typing import Any, Callable

from omnilab.errors import WorkerError
from omnilab.stages import lifecycle


def engine_processes(engine_core) -> list:
    mgr = getattr(getattr(engine_core, "resources", None), "engine_manager", None)
    return list(getattr(mgr, "processes", []) or [])


def engine_alive(engine_core) -> bool:
    res = getattr(engine_core, "resources", None)
    if res is None:
        return True  # in-process engine
    if getattr(res, "engine_dead", False):
        return False
    return all(p.is_alive() for p in engine_processes(engine_core))


def _how(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _pid_alive(pid: int) -> bool:
    """A process that is not our child: alive unless gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def death_cause(engine_core, worker_pids: int | list[int] | None) -> str | None:
    dead = [f"the engine-core process (pid {p.pid}) {_how(p.exitcode)}"
            for p in engine_processes(engine_core) if not p.is_alive()]
    pids = [worker_pids] if isinstance(worker_pids, int) else list(worker_pids or ())
    for rank, pid in enumerate(pids):
        if not _pid_alive(pid):
            which = f" (tensor-parallel rank {rank})" if len(pids) > 1 else ""
            dead.append(f"the talker worker process{which} (pid {pid}) exited")
    return "; ".join(dead) or None


def is_dead_error(e: BaseException) -> bool:
    from vllm.v1.engine.exceptions import EngineDeadError
    return isinstance(e, EngineDeadError)


def timed_rpc(engine_core, method: str, args: tuple, timeout_s: float, alive: Callable[[], bool],
              poll_s: float = 0.5) -> Any:
    send, results = getattr(engine_core, "_send_input", None), getattr(engine_core, "utility_results", None)
    if send is None or results is None:  # not vLLM 0.32's multiprocess client: its own (untimed) call
        return engine_core.collective_rpc(method, timeout_s, args, None)
    from vllm.v1.engine import EngineCoreRequestType

    call_id = uuid.uuid1().int >> 64  # as vLLM's call_utility
    future: concurrent.futures.Future = concurrent.futures.Future()
    results[call_id] = future
    send(EngineCoreRequestType.UTILITY, (0, call_id, "collective_rpc", (method, timeout_s, args, None)))
    deadline = time.perf_counter() + timeout_s
    try:
        while True:
            try:
                return future.result(timeout=poll_s)
            except concurrent.futures.TimeoutError:
                pass
            if not alive():
                raise WorkerError(f"the vLLM engine died during RPC {method!r}")
            if time.perf_counter() > deadline:
                raise TimeoutError(method)
    finally:
        results.pop(call_id, None)


def wait_for_output(engine_core, timeout_s: float, alive: Callable[[], bool], poll_s: float = 0.5) -> str:
    """Block until the multiprocess client holds a step's outputs -> ``"ready"``, checking every ``poll_s`` that the
    engine lives (vLLM's sync client would otherwise wait forever on a killed engine core): ``"dead"`` as soon as
    ``alive()`` is False, ``"timeout"`` after ``timeout_s``. ``"ready"`` at once where there is no queue."""
    q = getattr(engine_core, "outputs_queue", None)
    if q is None:
        return "ready"
    deadline = time.perf_counter() + timeout_s
    while True:
        with q.not_empty:
            if q._qsize() > 0 or q.not_empty.wait(timeout=poll_s) or q._qsize() > 0:
                return "ready"
        if not alive():
            return "dead"
        if time.perf_counter() > deadline:
            return "timeout"


def renice(engine, nice: int) -> None:
    """Lower the priority of every thread of the engine-core process(es) (see ``engine_core_nice``)."""
    for p in engine_processes(engine.engine_core):
        with contextlib.suppress(OSError, TypeError):
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def shutdown(engine_core) -> None:
    """Stop the engine and reap its engine-core processes.

    vLLM's shutdown sends SIGTERM, waits ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` and then SIGKILLs what is left,
    without waiting for it: a killed engine core stays a zombie child of this process until something reaps it
    (seen after a dead tensor-parallel rank, whose engine core takes more than the 5 s grace to leave). So every
    engine-core process is reaped here, with no second grace: vLLM gave it one, and one still running after a
    shutdown that raised midway is killed."""
    procs = engine_processes(engine_core)
    with contextlib.suppress(Exception):
        engine_core.shutdown()
    for p in procs:
        with contextlib.suppress(Exception):
            lifecycle.reap(p, 0.0)
