"""The code2wav generation worker process: same audio as in-process decoding, batching, timing, binding,
freeing, and a dead worker surfacing as an error (no vLLM involved)."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from omnilab.errors import InputError, WorkerError
from omnilab.checkpoint.load import load_model
from omnilab.stages.code2wav.stage import Code2WavStage
from omnilab.stages.code2wav.worker import Code2WavWorker

CPU = (sorted(os.sched_getaffinity(0))[-1],)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("custom_voice")


@pytest.fixture(scope="module")
def local(ckpt):
    """In-process decoding on as many threads as the worker: equal by construction (same kernels, shapes and
    thread count; both loaders give 64-byte aligned weights)."""
    return Code2WavStage(load_model(ckpt, dtype="float32", load_encoders=False).code2wav, threads=len(CPU))


@pytest.fixture(scope="module")
def worker(ckpt):
    w = Code2WavWorker(ckpt, cpus=CPU, threads=1)
    yield w
    w.close()


def _codes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2048, size=(n, 16))


def test_offline_decode_matches_in_process(worker, local):
    codes = _codes(0, 12)
    np.testing.assert_array_equal(worker.decode(codes), local.decode(codes))
    prefix = _codes(1, 5)
    np.testing.assert_array_equal(worker.decode(codes, prefix_codes=prefix), local.decode(codes, prefix_codes=prefix))


def test_two_streams_batched_and_equal_to_in_process(worker, local):
    a, b = _codes(2, 15), _codes(3, 15)
    sa, sb = worker.open_session("a"), worker.open_session("b", prefix_codes=_codes(4, 3))
    la, lb = local.open_session("a"), local.open_session("b", prefix_codes=_codes(4, 3))
    got = {"a": [], "b": []}
    batches = []
    try:
        for lo, hi in [(0, 1), (1, 3), (3, 7), (7, 15)]:  # a 1, 2, 4, 8 ramp
            sa.submit(a[lo:hi])
            sb.submit(b[lo:hi])
            results = []
            while len(results) < 2:
                results += worker.poll(timeout=30.0)
            for r in results:
                assert r.error is None and r.audio.dtype == np.float32 and len(r.audio) == (hi - lo) * 1920
                assert r.hop_in_ms >= 0 and r.hop_out_ms >= 0 and r.timing["decode_ms"] > 0
                got[r.request_id].append(r.audio)
                batches.append(r.timing["batch"])
        ref_a = np.concatenate([la.push(a[lo:hi]) for lo, hi in [(0, 1), (1, 3), (3, 7), (7, 15)]])
        ref_b = np.concatenate([lb.push(b[lo:hi]) for lo, hi in [(0, 1), (1, 3), (3, 7), (7, 15)]])
        # batched rows round like a Linear over 2 rows, not bit for bit like one row
        np.testing.assert_allclose(np.concatenate(got["a"]), ref_a, atol=1e-4)
        np.testing.assert_allclose(np.concatenate(got["b"]), ref_b, atol=1e-4)
        assert max(batches) == 2, "chunks of the two streams were never decoded together"
        spans = sa.take_spans()
        assert {s["name"] for s in spans} == {"hop", "code2wav_chunk"}
        assert {s["pid"] for s in spans if s["name"] == "code2wav_chunk"} == {worker.proc.pid}
        assert all(s["request_id"] == "a" for s in spans)
    finally:
        for s in (sa, sb, la, lb):
            s.close()
    assert worker.num_sessions == 0 and worker.info()["sessions"] == []


def test_sync_push_and_closed_session(worker, local):
    s = worker.open_session("c")
    codes = _codes(5, 4)
    audio = s.push(codes)
    assert audio.shape == (4 * 1920,)
    s.close()
    with pytest.raises(InputError):
        s.push(codes)
    with pytest.raises(InputError):
        worker.open_session("d").submit(np.zeros((2, 3), dtype=np.int64))
    worker._sessions["d"].close()


def test_binding_read_back(worker):
    info = worker.info()
    assert info["pid"] == worker.proc.pid != os.getpid()
    assert tuple(info["affinity"]) == CPU
    assert info["torch_threads"] == 1
    assert all(mask == ",".join(map(str, CPU)) for mask in info["thread_cpus"].values())
    assert worker.processes() == {worker.proc.pid: "code2wav"}


def test_dead_worker_raises_quickly(ckpt):
    w = Code2WavWorker(ckpt, cpus=CPU, threads=1)
    s = w.open_session("x")
    s.push(_codes(6, 1))
    os.kill(w.proc.pid, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(WorkerError, match="exited"):
        s.push(_codes(6, 2))
    assert time.perf_counter() - t0 < 15.0
    w.close()
    assert not w.alive


def test_close_stops_process(ckpt):
    with Code2WavWorker(ckpt, threads=1) as w:
        pid = w.proc.pid
        assert w.alive
    assert not w.alive
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
