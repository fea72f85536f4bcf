"""``liveness.shutdown`` leaves no engine-core process behind, running or as a zombie.

vLLM's own shutdown SIGKILLs an engine core that outlives its grace period without reaping it, so the process stays
a zombie child of the client (seen in CI after a dead tensor-parallel rank: ``test_abort_close_and_a_dead_rank``
counted it as left over). These tests stand in for vLLM's client with a fake one whose engine core ignores SIGTERM,
so they run in a second, without vLLM.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import types

import psutil

from omnilab.stages.vllm import liveness


def _stubborn(ready) -> None:  # an engine core that ignores SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    while True:
        time.sleep(0.1)


def _fake_client(kill_like_vllm: bool):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_stubborn, args=(ready,), daemon=True)
    proc.start()
    assert ready.wait(30)

    def shutdown(timeout=None):
        proc.terminate()  # ignored
        if not kill_like_vllm:
            raise RuntimeError("shutdown failed midway")
        os.kill(proc.pid, signal.SIGKILL)  # as vLLM's kill_process_tree: no join afterwards

    mgr = types.SimpleNamespace(processes=[proc])
    return types.SimpleNamespace(resources=types.SimpleNamespace(engine_manager=mgr, engine_dead=False),
                                 shutdown=shutdown), proc


def _cleanup(proc) -> None:  # a failing test must not hang the interpreter's exit on a SIGTERM-proof child
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def _child_pids() -> set[int]:  # zombies included, as psutil lists them
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_a_killed_engine_core_is_reaped_not_left_a_zombie():
    core, proc = _fake_client(kill_like_vllm=True)
    try:
        liveness.shutdown(core)
        assert proc.pid not in _child_pids()
        assert proc.exitcode == -signal.SIGKILL
    finally:
        _cleanup(proc)


def test_an_engine_core_left_running_by_a_failed_shutdown_is_killed_and_reaped():
    core, proc = _fake_client(kill_like_vllm=False)
    try:
        t0 = time.perf_counter()
        liveness.shutdown(core)
        assert proc.pid not in _child_pids()
        assert not liveness.engine_alive(core)
        assert time.perf_counter() - t0 < 10
    finally:
        _cleanup(proc)
