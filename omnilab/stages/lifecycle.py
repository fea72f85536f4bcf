"""The life of stage worker processes: they die with their client, every wait on them has a timeout, and a
script that cannot spawn them (no ``if __name__ == "__main__":`` guard) is told so. Plain Python (no torch).

Contract:
- ``worker_timeout_s(environ=None) -> float``: how long the client waits for any answer of a worker (a chunk,
  a step's output, an RPC) before raising :class:`~omnilab.errors.WorkerError`: ``OMNILAB_WORKER_TIMEOUT_S``
  (seconds > 0), default :data:`DEFAULT_WORKER_TIMEOUT_S` (120 s: a 0.6B chunk or step takes well under 1 s,
  a long prefill on 2 cores a few seconds; a frozen or stopped worker must not block a stream forever). A
  bad value is a :class:`~omnilab.errors.ConfigError` naming it. Start-up waits take at least
  :data:`START_TIMEOUT_S` (loading weights is slower than answering).
- ``parent_token()`` (client side, at spawn) -> what a child needs to die with this process: its pid, and
  ``":t"`` when the spawning thread is not the main thread (a parent-death signal fires when the *thread*
  that spawned the child ends, so it is only armed for children of a main thread; the pid watch below
  always runs). ``PARENT_ENV`` carries it to processes that vLLM spawns (engine core, talker worker).
- ``die_with_parent(token)`` (child side, first thing): arms ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, then
  re-checks ``getppid()`` (a parent that died before the prctl is caught here), and starts a daemon thread
  that kills this process within ``WATCH_S`` of the parent's death (re-parenting changes ``getppid()``) and keeps
  to the main thread's CPU mask (a worker pins its threads after the watch started).
  ``adopt_parent_from_env()`` does the same from ``PARENT_ENV`` and then names this process as the parent
  of its own children (vLLM's engine core spawns the talker worker).
- ``check_spawnable(what)``: called before a worker is spawned. In a process that is itself being started
  by ``multiprocessing``'s spawn and is re-running the user's main script (no ``__main__`` guard), prints
  one line and exits with :data:`MAIN_GUARD_EXIT_CODE` before anything is built (so nothing is leaked);
  the client turns that exit code into ``main_guard_error(what)``.
- ``reap(proc, grace_s)``: wait up to ``grace_s`` for a ``multiprocessing`` process that was asked to stop, kill it if
  it still runs, and join it: it is neither left running nor a zombie child of this process.
- ``restart_stages(talker, code2wav) -> (talker, code2wav)`` (``Pipeline.restart``): a stage with worker
  processes is closed and replaced by ``stage.respawn()`` (new processes, built as before: code2wav first, as at
  build time); a stage in this process is closed (its requests and sessions dropped) and kept.
"""
from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
import threading
import time
from typing import Mapping

from omnilab import settings
from omnilab.errors import ConfigError, WorkerError

WORKER_TIMEOUT_ENV = "OMNILAB_WORKER_TIMEOUT_S"
DEFAULT_WORKER_TIMEOUT_S = 120.0
START_TIMEOUT_S = 300.0
PARENT_ENV = "OMNILAB_WORKER_PARENT"
MAIN_GUARD_EXIT_CODE = 78  # EX_CONFIG
WATCH_S = 0.5
_PR_SET_PDEATHSIG = 1
_watching: list[int] = []


def worker_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    raw = (settings.raw(WORKER_TIMEOUT_ENV, environ) or "").strip()
    if not raw:
        return DEFAULT_WORKER_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{WORKER_TIMEOUT_ENV}={raw!r} is not a timeout; accepted: a number of seconds > 0 "
                          f"(unset: {DEFAULT_WORKER_TIMEOUT_S:.0f})")
    return value


def timeout_error(worker: str, wait: str, timeout_s: float) -> WorkerError:
    return WorkerError(f"{worker} did not answer {wait} within {timeout_s:g} s ({WORKER_TIMEOUT_ENV}); it is "
                       f"stopped, frozen or overloaded. Close this pipeline (or pipe.restart()) to replace it")


def reap(proc, grace_s: float) -> None:
    proc.join(grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)


# ---- parent death -----------------------------------------------------------------------------------------
def parent_token() -> str:
    main = threading.current_thread() is threading.main_thread()
    return f"{os.getpid()}" if main else f"{os.getpid()}:t"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(token: str | None) -> None:
    """In a worker process: exit (SIGKILL) when the process named by ``token`` dies. Idempotent."""
    if not token:
        return
    pid_s, _, flag = str(token).partition(":")
    parent = int(pid_s)
    if parent == os.getpid() or parent in _watching:
        return
    direct = os.getppid() == parent
    if direct and flag != "t" and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watch thread below still runs
    if direct and os.getppid() != parent:  # the parent died before the prctl: it will never fire
        _die()
    if not direct and not _alive(parent):
        _die()
    _watching.append(parent)

    def watch() -> None:
        while True:
            time.sleep(WATCH_S)
            if (os.getppid() != parent) if direct else not _alive(parent):
                _die()
            try:  # follow the main thread's CPU mask (workers pin it after this thread started)
                mask = os.sched_getaffinity(os.getpid())
                if mask != os.sched_getaffinity(0):
                    os.sched_setaffinity(0, mask)
            except OSError:
                pass

    threading.Thread(target=watch, name="omnilab-parent-watch", daemon=True).start()


def adopt_parent_from_env() -> None:
    """In a process vLLM spawned (``PARENT_ENV`` set by the client): die with the parent, then become the
    parent its own children watch."""
    token = settings.raw(PARENT_ENV)
    if not token or token.partition(":")[0] == str(os.getpid()):
        return
    try:
        die_with_parent(token)
    except ValueError:
        return
    os.environ[PARENT_ENV] = parent_token()


# ---- spawning from a script without a __main__ guard ------------------------------------------------------
def _bootstrapping() -> bool:
    import multiprocessing.process as mpp
    return bool(getattr(mpp.current_process(), "_inheriting", False))


def main_guard_message(what: str) -> str:
    main = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
    return (f"the {what} could not start: {main} builds a Pipeline with worker processes at import time, "
            "without an `if __name__ == \"__main__\":` guard, so each spawned worker re-runs it. Fix: put the "
            "code that builds and uses the Pipeline under `if __name__ == \"__main__\":` (or use "
            "deploy=\"inprocess\")")


def main_guard_error(what: str) -> WorkerError:
    return WorkerError(main_guard_message(what))


# The child leaves this file (path from the parent, in MARKER_ENV) before exiting for want of a guard: vLLM's own
# error names the engine core's exit code only when the process had exited by the time it gave up, which a loaded
# host does not promise ("Failed core proc(s): {}"), so the parent asks the file, not vLLM's message.
MARKER_ENV = "OMNILAB_SPAWN_MARKER"


def spawn_marker() -> str:
    """A fresh path (not created) for MARKER_ENV."""
    import tempfile
    fd, path = tempfile.mkstemp(prefix="omnilab-spawn-")
    os.close(fd)
    os.unlink(path)
    return path


def guard_tripped(path: str) -> bool:
    """Whether a child left the marker at ``path`` (removed either way)."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def check_spawnable(what: str) -> None:
    if _bootstrapping():
        marker = settings.raw(MARKER_ENV)
        if marker:
            open(marker, "w").close()
        sys.stderr.write(f"omnilab: {main_guard_message(what)}\n")
        sys.stderr.flush()
        raise SystemExit(MAIN_GUARD_EXIT_CODE)


# ---- restart ----------------------------------------------------------------------------------------------
def restart_stages(talker, code2wav):
    def renew(stage):
        if hasattr(stage, "respawn"):
            return stage.respawn()
        stage.close()
        return stage

    new_code2wav = renew(code2wav)
    try:
        return renew(talker), new_code2wav
    except BaseException:
        if new_code2wav is not code2wav:
            new_code2wav.close()
        raise
