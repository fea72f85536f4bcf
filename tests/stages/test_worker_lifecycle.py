"""The code2wav worker's lifecycle (no vLLM): a bad OMNILAB_WORKER_TIMEOUT_S is a ConfigError, a frozen
(SIGSTOPped) worker becomes a WorkerError naming the worker, the wait and the timeout, ``respawn()`` gives a
working worker, and a worker whose client is killed mid-decode exits within 10 s."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

from omnilab.errors import ConfigError, WorkerError
from omnilab.stages import lifecycle
from omnilab.stages.code2wav.worker import Code2WavWorker

CPU = (sorted(os.sched_getaffinity(0))[-1],)


def _codes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2048, size=(n, 16))


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if not gone(p)]


@pytest.mark.parametrize("raw", ["banana", "0", "-3", "inf", "nan"])
def test_bad_timeout_is_config_error_naming_it(raw, monkeypatch, tiny_ckpt):
    with pytest.raises(ConfigError, match=f"OMNILAB_WORKER_TIMEOUT_S='{raw}'.*seconds > 0"):
        lifecycle.worker_timeout_s({"OMNILAB_WORKER_TIMEOUT_S": raw})
    monkeypatch.setenv("OMNILAB_WORKER_TIMEOUT_S", raw)
    with pytest.raises(ConfigError, match="OMNILAB_WORKER_TIMEOUT_S"):  # before any process is spawned
        Code2WavWorker(tiny_ckpt("custom_voice"), threads=1)


def test_timeout_default_and_override():
    assert lifecycle.worker_timeout_s({}) == lifecycle.DEFAULT_WORKER_TIMEOUT_S == 120.0
    assert lifecycle.worker_timeout_s({"OMNILAB_WORKER_TIMEOUT_S": " 2.5 "}) == 2.5


def test_frozen_worker_times_out_then_respawn_works(monkeypatch, tiny_ckpt):
    monkeypatch.setenv("OMNILAB_WORKER_TIMEOUT_S", "2")
    w = Code2WavWorker(tiny_ckpt("custom_voice"), cpus=CPU, threads=1)
    try:
        assert w.timeout_s == 2.0
        s = w.open_session("a")
        good = s.push(_codes(0, 2))
        os.kill(w.proc.pid, signal.SIGSTOP)
        t0 = time.perf_counter()
        with pytest.raises(WorkerError) as e:
            s.push(_codes(1, 2))
        took = time.perf_counter() - t0
        msg = str(e.value)
        assert f"code2wav worker (pid {w.proc.pid})" in msg and "chunk" in msg and "'a'" in msg
        assert "2 s" in msg and "OMNILAB_WORKER_TIMEOUT_S" in msg
        assert 1.9 <= took < 10.0
        with pytest.raises(WorkerError, match="info"):
            w.info()
        old = w.proc.pid
        w2 = w.respawn()  # closes the stopped one (SIGKILL works on a stopped process)
        assert wait_gone([old], 10.0) == []
        w = w2
        assert w.proc.pid != old and w.timeout_s == 2.0
        s = w.open_session("a")
        np.testing.assert_array_equal(s.push(_codes(0, 2)), good)
    finally:
        with_cont = w.proc.pid
        if not gone(with_cont):
            os.kill(with_cont, signal.SIGCONT)
        w.close()


CLIENT = textwrap.dedent("""
    import json, sys, numpy as np
    from omnilab.stages.code2wav.worker import Code2WavWorker

    if __name__ == "__main__":
        w = Code2WavWorker(sys.argv[1], threads=1)
        s = w.open_session("r")
        s.push(np.zeros((1, 16), dtype=np.int64))
        print(json.dumps({"pids": [w.proc.pid]}), flush=True)
        while True:  # decoding long chunks when the client is killed
            s.submit(np.random.default_rng(0).integers(0, 2048, size=(200, 16)))
            w.poll(timeout=60.0)
""")


def run_client(script: str, args: list[str], tmp_path, timeout_s: float = 600.0):
    """Start ``script`` in a fresh interpreter -> (Popen, the JSON its first stdout line prints)."""
    path = tmp_path / "client.py"
    path.write_text(script)
    proc = subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("{"):
            return proc, json.loads(line)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"the client printed no pids (rc {proc.wait()}): {proc.stderr.read()[-3000:]}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_code2wav_worker_exits_with_its_killed_client(sig, tmp_path, tiny_ckpt):
    proc, info = run_client(CLIENT, [str(tiny_ckpt("custom_voice"))], tmp_path, timeout_s=300.0)
    try:
        time.sleep(0.5)  # inside a decode
        os.kill(proc.pid, sig)
        proc.wait(10.0)
        assert wait_gone(info["pids"], 10.0) == [], "the code2wav worker outlived its client"
    finally:
        proc.kill()
        for p in info["pids"]:
            if not gone(p):
                os.kill(p, signal.SIGKILL)
