"""The code2wav generation worker: its own process, cores and threads; code chunks in, float32 audio out.

Contract:
- ``Code2WavWorker(checkpoint, cpus=..., threads=...)`` spawns one process that pins itself to ``cpus``
  (``sched_setaffinity`` plus ``OMP_NUM_THREADS``/``OMP_PLACES`` set before torch starts) and loads only
  the code2wav decoder from ``speech_tokenizer/model.safetensors``, its conv decoder in ``dtype`` (the client's
  ``omnilab.tuning.code2wav_dtype.Code2WavDtype``, sent with the spawn arguments; None = resolved here for an fp32
  pipeline: fp32 unless ``OMNILAB_CODE2WAV_DTYPE`` says otherwise). ``info()["code2wav_dtype"]`` reads it back;
  ``info()["code2wav_conv"]``, the fp32 conv path the worker's decoder took from the environment it inherited.
- The same API as :class:`~omnilab.stages.code2wav.stage.Code2WavStage` (``decode``, ``open_session`` ->
  session with ``push(codes [F, 16]) -> audio``, ``num_sessions``, ``close``) plus an asynchronous one:
  ``session.submit(codes) -> seq`` and ``worker.poll(timeout) -> [ChunkResult]``. The worker holds one
  explicit decoder state per open request (``Code2WavState``; left context = the decoder's 72-frame
  window), decodes the ready chunks of several requests together (equal lengths batched) and frees a
  state on ``close``/abort.
- Every chunk carries its timing on one clock (``perf_counter`` = CLOCK_MONOTONIC, shared by all
  processes): sent, received by the worker, decode start/end, received back; ``hop_in_ms`` and
  ``hop_out_ms`` are the pipe latencies, ``decode_ms`` the decoder time, ``batch`` the chunks decoded
  together.
- A worker that dies raises :class:`~omnilab.errors.WorkerError` in the caller within ``poll_s`` (0.2 s)
  of the death, never a hang; one that does not answer (stopped, frozen) raises it after ``timeout_s``
  (``OMNILAB_WORKER_TIMEOUT_S``, default 120 s; :mod:`omnilab.stages.lifecycle`), naming the worker, the wait
  and the timeout. The process dies with its client (parent-death signal, a pid watch, EOF on the pipe).
  Spawned from a script without a ``__main__`` guard, it is a ``WorkerError`` saying so.
  ``close()`` (also a finalizer) stops the process.
Messages are pickled over a ``multiprocessing`` pipe (chunks are at most a few hundred KB).
The process side (``_worker_main``, the spawn target) lives in
``omnilab.stages.code2wav.worker_proc``.
"""
from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np

from omnilab.errors import InputError, WorkerError
from omnilab.stages import lifecycle
from omnilab.stages._env import temporary_environ
from omnilab.stages.code2wav.codes import codes_array
from omnilab.stages.code2wav.worker_proc import _GATHER_S, _handle, _info, _worker_main  # noqa: F401
from omnilab.tuning.code2wav_dtype import code2wav_dtype_choice

_OFFLINE = "__offline_decode__"


# ------------------------------------------------------------------------------------------ driver side
@dataclass
class ChunkResult:
    request_id: Hashable
    seq: int
    audio: np.ndarray | None          # float32 [F * 1920]; None on error
    timing: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def hop_in_ms(self) -> float:
        return 1e3 * (self.timing["t_recv"] - self.timing["t_send"])

    @property
    def hop_out_ms(self) -> float:
        return 1e3 * (self.timing["t_back"] - self.timing["t_reply"])


class RemoteCode2WavSession:
    """One request's stream in the worker. ``push`` is synchronous; ``submit`` + ``worker.poll`` are not."""

    def __init__(self, worker: "Code2WavWorker", request_id: Hashable, prefix_codes=None):
        self.worker, self.request_id = worker, request_id
        self.frames_done = 0
        self.decode_ms: list[float] = []
        self.closed = False
        prefix = None if prefix_codes is None or not len(prefix_codes) else codes_array(prefix_codes, "prefix_codes")
        worker._send(("open", request_id, prefix))

    def take_spans(self) -> list[dict[str, Any]]:
        """Spans of this stream's decoded chunks (hop in, decode in the worker, hop out) since last call."""
        return self.worker._take_spans(self.request_id)

    def submit(self, codes) -> int:
        if self.closed:
            raise InputError(f"code2wav session {self.request_id!r} is closed")
        codes = codes_array(codes)  # refused here, before it reaches the worker
        seq = next(self.worker._seq)
        self.worker._frames[(self.request_id, seq)] = (self.frames_done, codes.shape[0])
        self.worker._send(("push", self.request_id, seq, codes.astype(np.int64), time.perf_counter()))
        self.frames_done += codes.shape[0]
        return seq

    def push(self, codes) -> np.ndarray:
        if len(codes) == 0:
            return np.zeros(0, dtype=np.float32)
        r = self.worker.wait(self.request_id, self.submit(codes))
        self.decode_ms.append(r.timing.get("decode_ms", 0.0))
        return r.audio

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.worker._sessions.pop(self.request_id, None)
            if self.worker.alive:
                self.worker._send(("close", self.request_id))

    def __repr__(self) -> str:
        return f"RemoteCode2WavSession({self.request_id!r}, frames_done={self.frames_done}, closed={self.closed})"


def _stop(proc, conn) -> None:
    with contextlib.suppress(Exception):
        conn.send(("stop",))
    lifecycle.reap(proc, 5.0)
    with contextlib.suppress(Exception):
        conn.close()


class Code2WavWorker:
    backend = "process"

    def __init__(self, checkpoint: str | os.PathLike, *, cpus: Sequence[int] | None = None, threads: int | None = None,
                 poll_s: float = 0.2, env: dict[str, str] | None = None, dtype: Any = None,
                 timeout_s: float | None = None):
        self.timeout_s = lifecycle.worker_timeout_s() if timeout_s is None else float(timeout_s)
        lifecycle.check_spawnable("code2wav worker")
        self._spawn_kwargs = dict(checkpoint=checkpoint, cpus=cpus, threads=threads, poll_s=poll_s, env=env,
                                  dtype=dtype, timeout_s=timeout_s)
        cpus = tuple(int(c) for c in cpus) if cpus else None
        threads = int(threads or (len(cpus) if cpus else 1))
        self.cpus, self.threads, self.poll_s = cpus, threads, poll_s
        if dtype is None:
            dtype = code2wav_dtype_choice("float32")  # a stand-alone worker: fp32 unless the variable says
        name = getattr(dtype, "dtype", dtype)  # a Code2WavDtype, or its name
        if name not in ("float32", "bfloat16"):
            raise InputError(f"code2wav worker dtype {dtype!r} is not supported; accepted: a Code2WavDtype, "
                             f"'float32', 'bfloat16'")
        self.dtype = dtype
        self._seq = itertools.count()
        self._spans: list[dict[str, Any]] = []
        self._frames: dict[tuple[Hashable, int], tuple[int, int]] = {}
        self._sessions: dict[Hashable, RemoteCode2WavSession] = {}
        self._inbox: dict[tuple[Hashable, int], ChunkResult] = {}
        self._done: list[ChunkResult] = []
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        env = {**(env or {}), "OMP_NUM_THREADS": str(threads)}
        if cpus:
            env.update(OMP_PLACES="{" + "},{".join(map(str, cpus)) + "}", OMP_PROC_BIND="true")
        t0 = time.perf_counter()
        with temporary_environ(env):
            self.proc = ctx.Process(target=_worker_main, args=(child, str(checkpoint), cpus, threads, name,
                                                               lifecycle.parent_token()),
                                    name="omnilab-code2wav", daemon=True)
            self.proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _stop, self.proc, self._conn)
        try:
            msg = self._recv(max(lifecycle.START_TIMEOUT_S, self.timeout_s), "its start (loading the decoder)")
        except WorkerError:
            self._finalizer()
            raise
        if msg[0] != "ready":
            raise WorkerError(f"code2wav worker failed to start: {msg}")
        self.init_s = time.perf_counter() - t0
        self.start_info = msg[1]

    # ---- transport ----------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._finalizer.alive and self.proc.is_alive()

    @property
    def _name(self) -> str:
        return f"the code2wav worker (pid {self.proc.pid})"

    def _exited(self) -> WorkerError:
        code = self.proc.exitcode
        if code == lifecycle.MAIN_GUARD_EXIT_CODE:
            return lifecycle.main_guard_error("code2wav worker")
        return WorkerError(f"{self._name} exited with code {code}")

    def _send(self, msg) -> None:
        if not self._finalizer.alive:
            raise InputError("the code2wav worker is closed")
        if not self.proc.is_alive():
            raise self._exited()
        try:
            self._conn.send(msg)
        except (BrokenPipeError, OSError) as e:
            raise WorkerError(f"the code2wav worker (pid {self.proc.pid}) is gone: {e}") from None

    def _recv(self, timeout: float | None = None, wait: str = "a message"):
        """The next message; WorkerError if the worker exits or sends nothing for ``timeout`` s (None:
        ``self.timeout_s``)."""
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.perf_counter() + timeout
        while True:
            try:
                if self._conn.poll(self.poll_s):
                    return self._conn.recv()
            except (EOFError, OSError):
                pass
            if not self.proc.is_alive():
                self.proc.join(1.0)  # the exit code is set once the process is reaped
                raise self._exited()
            if time.perf_counter() > deadline:
                raise lifecycle.timeout_error(self._name, wait, timeout)

    def _file(self, msg) -> ChunkResult | None:
        if msg[0] == "audio":
            _, rid, seq, audio, timing = msg
            timing["t_back"] = time.perf_counter()
            self._record(rid, seq, timing)
            return ChunkResult(rid, seq, audio, timing)
        if msg[0] == "error":
            return ChunkResult(msg[1], msg[2], None, {}, msg[3])
        raise WorkerError(f"unexpected message from the code2wav worker: {msg[0]!r}")

    def poll(self, timeout: float = 0.0) -> list[ChunkResult]:
        """Chunk results that arrived (waiting up to ``timeout`` s for the first one)."""
        out, self._done = list(self._inbox.values()) + self._done, []
        self._inbox.clear()
        deadline = time.perf_counter() + timeout
        while True:
            if self._conn.poll(0):
                out.append(self._file(self._recv()))
                continue
            if out or time.perf_counter() >= deadline:
                break
            if not self.proc.is_alive():
                raise self._exited()
            self._conn.poll(min(self.poll_s, max(deadline - time.perf_counter(), 0.0)))
        return out

    def wait(self, request_id: Hashable, seq: int, timeout: float | None = None) -> ChunkResult:
        """Block until chunk ``seq`` of ``request_id`` is back (other results are kept for ``poll``)."""
        key = (request_id, seq)
        while key not in self._inbox:
            r = self._file(self._recv(timeout, f"chunk {seq} of request {request_id!r}"))
            self._inbox[(r.request_id, r.seq)] = r
        r = self._inbox.pop(key)
        if r.error:
            raise WorkerError(f"code2wav worker: {r.error}")
        return r

    def _record(self, rid: Hashable, seq: int, t: dict[str, float]) -> None:
        f0, n = self._frames.pop((rid, seq), (0, 0))
        if rid == _OFFLINE:  # the caller records offline decodes itself
            return
        me, wpid, wtid = os.getpid(), t.get("pid", -1), t.get("tid", -1)
        common = {"request_id": str(rid), "frame_index": f0, "attrs": {"seq": seq, "batch": t.get("batch", 1)}}
        self._spans += [
            dict(common, name="hop", stage="client", start_s=t["t_send"], end_s=t["t_recv"], pid=me,
                 tid=threading.get_native_id(), attrs=dict(common["attrs"], direction="to_code2wav")),
            dict(common, name="code2wav_chunk", stage="code2wav", start_s=t["t_start"], end_s=t["t_done"],
                 pid=wpid, tid=wtid, num_frames=n, cpu_ms=t.get("cpu_ms", float("nan"))),
            dict(common, name="hop", stage="client", start_s=t["t_reply"], end_s=t["t_back"], pid=me,
                 tid=threading.get_native_id(), attrs=dict(common["attrs"], direction="from_code2wav")),
        ]

    def _take_spans(self, request_id: Hashable | None = None) -> list[dict[str, Any]]:
        if request_id is None:
            out, self._spans = self._spans, []
            return out
        rid = str(request_id)
        out = [s for s in self._spans if s["request_id"] == rid]
        self._spans = [s for s in self._spans if s["request_id"] != rid]
        return out

    def take_spans(self) -> list[dict[str, Any]]:
        """Spans of every chunk decoded since the last call (see ``RemoteCode2WavSession.take_spans``)."""
        return self._take_spans()

    def processes(self) -> dict[int, str]:
        return {self.proc.pid: "code2wav"} if self.alive else {}

    # ---- Code2WavStage API ----------------------------------------------------------------------
    def open_session(self, request_id: Hashable, prefix_codes=None) -> RemoteCode2WavSession:
        if request_id in self._sessions:
            raise InputError(f"a code2wav session for {request_id!r} is already open")
        s = RemoteCode2WavSession(self, request_id, prefix_codes)
        self._sessions[request_id] = s
        return s

    def decode(self, codes, prefix_codes=None) -> np.ndarray:
        """Whole-utterance decode ``[T, 16]`` -> float32 ``[T * 1920]`` (in the worker)."""
        codes = codes_array(codes)  # refused here, before it reaches the worker
        prefix_codes = (None if prefix_codes is None or not len(prefix_codes)
                        else codes_array(prefix_codes, "prefix_codes"))
        if len(codes) == 0:
            return np.zeros(0, dtype=np.float32)
        rid, seq = _OFFLINE, next(self._seq)
        self._frames[(rid, seq)] = (0, len(codes))
        self._send(("decode", rid, seq, codes.astype(np.int64),
                    prefix_codes, time.perf_counter()))
        return self.wait(rid, seq).audio

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def info(self) -> dict[str, Any]:
        """pid, affinity, torch threads, per-thread CPU masks and open sessions, read in the worker."""
        self._send(("info",))
        while True:
            msg = self._recv(None, "info()")
            if msg[0] == "info":
                return msg[1]
            r = self._file(msg)
            self._inbox[(r.request_id, r.seq)] = r

    def respawn(self) -> "Code2WavWorker":
        """Close this worker and start a new one like it (same checkpoint, CPUs, threads, environment, dtype)."""
        self.close()
        return type(self)(**self._spawn_kwargs)

    def close(self) -> None:
        for s in list(self._sessions.values()):
            with contextlib.suppress(Exception):
                s.close()
        self._finalizer()

    def __enter__(self) -> "Code2WavWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Code2WavWorker(pid={self.proc.pid}, cpus={self.cpus}, threads={self.threads}, "
                f"sessions={len(self._sessions)}, alive={self.alive})")
