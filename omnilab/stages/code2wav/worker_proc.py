"""The code2wav worker's process side: the spawn entry point and its message loop.

Contract: ``_worker_main(conn, checkpoint, cpus, threads, dtype="float32", parent=None)`` is the ``multiprocessing``
(spawn) target started by :class:`~omnilab.stages.code2wav.worker.Code2WavWorker` (importable at module level). It
pins itself to ``cpus``, arranges to die with its client (``parent``: :func:`omnilab.stages.lifecycle.parent_token`
of the client; parent-death signal and a pid watch, so it exits even in the middle of a decode), loads the code2wav
decoder with its conv decoder in ``dtype`` (``"float32"`` / ``"bfloat16"``: the client's choice), sends
``("ready", info)`` and then serves the pipe protocol until ``("stop",)`` or EOF:
- ``("open", rid, prefix)`` / ``("close", rid)``: create / free one request's decoder state;
- ``("push", rid, seq, codes, t_send)``: queued; ready chunks of several requests are decoded together
  (one chunk per request per round) -> ``("audio", rid, seq, wav, timing)``;
- ``("decode", rid, seq, codes, prefix, t_send)``: a whole-utterance decode -> ``("audio", ...)``;
- ``("info",)`` -> ``("info", {pid, affinity, torch_threads, ...})``.
Any failure is answered with ``("error", rid, seq, message)`` and the worker keeps serving. torch is
imported only inside the process.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from omnilab.config import SAMPLES_PER_FRAME, SpeechTokenizerConfig
from omnilab.stages.lifecycle import die_with_parent

_GATHER_S = 0.002  # batching window when several streams are open
_MODEL: list = []  # the worker's decoder (for _info)


def _worker_main(conn, checkpoint: str, cpus: tuple[int, ...] | None, threads: int, dtype: str = "float32",
                 parent: str | None = None) -> None:
    """Process entry point (importable, for the spawn start method)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    die_with_parent(parent)  # after the pinning: its watch thread inherits this thread's CPU mask
    import torch

    from omnilab.models.code2wav_stream import decode_chunks  # lazy: torch
    from omnilab.checkpoint.worker_weights import load_code2wav_weights, release_memory  # lazy: torch

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    path = Path(checkpoint)
    speech = SpeechTokenizerConfig.load(path / "speech_tokenizer" / "config.json")
    model = load_code2wav_weights(path, speech).set_compute_dtype(getattr(torch, dtype)).prepare()
    release_memory()
    _MODEL[:] = [model]
    states: dict[Any, Any] = {}
    conn.send(("ready", _info(states)))

    def as_codes(a) -> torch.Tensor:  # [F, 16] -> [1, 16, F]
        return torch.as_tensor(np.asarray(a)).long().T[None].contiguous()

    def flush(pending: list) -> None:
        """Decode queued pushes: one chunk per request per round, several requests batched."""
        while pending:
            batch, rest, seen = [], [], set()
            for item in pending:
                (rest if item[1] in seen else batch).append(item)
                seen.add(item[1])
            pending[:] = rest
            live = [it for it in batch if it[1] in states]
            for it in batch:
                if it[1] not in states:
                    conn.send(("error", it[1], it[2], f"no open code2wav session for request {it[1]!r}"))
            if not live:
                continue
            t_start, c0 = time.perf_counter(), time.process_time()
            try:
                with torch.inference_mode():
                    wavs = decode_chunks(model, [states[it[1]] for it in live], [as_codes(it[3]) for it in live])
            except Exception as e:  # report, keep serving
                for it in live:
                    conn.send(("error", it[1], it[2], f"{type(e).__name__}: {e}"))
                continue
            t_done, cpu_ms = time.perf_counter(), 1e3 * (time.process_time() - c0)
            for it, w in zip(live, wavs):
                timing = {"t_send": it[4], "t_recv": it[5], "t_start": t_start, "t_done": t_done,
                          "decode_ms": 1e3 * (t_done - t_start), "cpu_ms": cpu_ms, "batch": len(live),
                          "pid": os.getpid(), "tid": threading.get_native_id(), "t_reply": time.perf_counter()}
                conn.send(("audio", it[1], it[2], w[0, 0].float().numpy(), timing))

    pending: list = []
    while True:
        try:
            msgs = [conn.recv()]
            while conn.poll():
                msgs.append(conn.recv())
            # Other streams are open: give their chunks (sent right after) a moment to join this batch.
            if len(states) > 1 and sum(m[0] == "push" for m in msgs) == 1 and conn.poll(_GATHER_S):
                while conn.poll():
                    msgs.append(conn.recv())
        except (EOFError, OSError):
            return
        t_recv = time.perf_counter()
        for msg in msgs:
            kind = msg[0]
            if kind == "push":  # ("push", rid, seq, codes, t_send)
                pending.append(msg[:5] + (t_recv,))
                continue
            flush(pending)
            try:
                if _handle(msg, model, states, conn, t_recv, as_codes, SAMPLES_PER_FRAME):
                    return
            except Exception as e:  # report to the caller, keep serving
                conn.send(("error", msg[1] if len(msg) > 1 else None, msg[2] if kind == "decode" else -1,
                           f"{type(e).__name__}: {e}"))
        flush(pending)


def _handle(msg, model, states, conn, t_recv, as_codes, spf) -> bool:
    """One control message; True = stop the worker."""
    import torch

    kind = msg[0]
    if kind == "open":  # ("open", rid, prefix_codes)
        _, rid, prefix = msg
        state = model.start_stream(1)
        if prefix is not None and len(prefix):
            with torch.inference_mode():
                model.decode_chunk(state, as_codes(prefix))
        states[rid] = state
    elif kind == "close":
        st = states.pop(msg[1], None)
        if st is not None:
            st.free()
    elif kind == "decode":  # ("decode", rid, seq, codes, prefix, t_send)
        _, rid, seq, codes, prefix, t_send = msg
        t_start = time.perf_counter()
        c = as_codes(codes)
        n_prefix = 0
        if prefix is not None and len(prefix):
            p = as_codes(prefix)
            n_prefix = p.shape[-1]
            c = torch.cat([p, c], dim=-1)
        with torch.inference_mode():
            wav = model.decode(c)[0, 0][n_prefix * spf:].float().numpy()
        t_done = time.perf_counter()
        conn.send(("audio", rid, seq, wav, {"t_send": t_send, "t_recv": t_recv, "t_start": t_start, "t_done": t_done,
                                            "decode_ms": 1e3 * (t_done - t_start), "batch": 1, "pid": os.getpid(),
                                            "tid": threading.get_native_id(),
                                            "t_reply": time.perf_counter()}))
    elif kind == "info":
        conn.send(("info", _info(states)))
    elif kind == "stop":
        states.clear()
        conn.send(("stopped",))
        return True
    return False


def _info(states: dict) -> dict[str, Any]:
    import torch

    from omnilab.kernels.snake import snake_choice  # lazy: torch
    tasks = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/status") as fh:
                for line in fh:
                    if line.startswith("Cpus_allowed_list:"):
                        tasks[int(tid)] = line.split(":", 1)[1].strip()
    return {"pid": os.getpid(), "affinity": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "sessions": sorted(map(str, states)),
            "thread_cpus": tasks, "snake": snake_choice().label,
            "code2wav_dtype": str(_MODEL[0].compute_dtype).removeprefix("torch.") if _MODEL else None,
            "code2wav_conv": _MODEL[0].conv_path.label if _MODEL else None}
