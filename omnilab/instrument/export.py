"""Derived views of a ``Trace`` that need more than a table: Trace Event JSON for Perfetto, and thread CPU
attributed to the stage that was running. Plain Python + numpy/pandas; used by ``omnilab.instrument.trace``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from omnilab.instrument.trace import Trace

# top-level work on a thread: what a CPU sample of that process is attributed to
_TOP_LEVEL = {"step": "talker", "code2wav_chunk": "code2wav", "admission": "client", "hop": "client",
              "consumer": "client"}


def _process_names(trace: "Trace") -> dict[int, str]:
    names = {int(k): str(v) for k, v in (trace.meta.get("processes") or {}).items()}
    for r in trace.thread_samples + trace.process_samples:
        names.setdefault(int(r["pid"]), str(r.get("role", "")))
    for s in trace.spans:
        names.setdefault(s.pid, s.stage)
    return names


def chrome_trace_events(trace: "Trace") -> list[dict[str, Any]]:
    """Trace Event format events (see ``Trace.to_chrome_trace``)."""
    t0 = trace.t0_s
    us = lambda t: round(1e6 * (t - t0), 3)  # noqa: E731
    ev: list[dict[str, Any]] = []
    for pid, role in sorted(_process_names(trace).items()):
        ev.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                   "args": {"name": f"{role} (pid {pid})" if role else f"pid {pid}"}})
    threads: dict[tuple[int, int], str] = {}
    for r in trace.thread_samples:
        threads.setdefault((int(r["pid"]), int(r["tid"])), str(r.get("thread", "")))
    for s in trace.spans:
        threads.setdefault((s.pid, s.tid), "main" if s.pid == s.tid else "")
    for (pid, tid), name in sorted(threads.items()):
        ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                   "args": {"name": f"{name or 'thread'} ({tid})"}})

    merged: dict[tuple, dict[str, Any]] = {}
    for s in trace.spans:
        if s.name == "request":
            common = {"cat": "request", "name": f"request {s.request_id}", "id": str(s.request_id),
                      "pid": s.pid, "tid": s.tid}
            ev.append({**common, "ph": "b", "ts": us(s.start_s), "args": dict(s.attrs)})
            ev.append({**common, "ph": "e", "ts": us(s.end_s)})
            continue
        if s.end_s <= s.start_s:
            ev.append({"ph": "i", "s": "t", "cat": s.stage, "name": s.name, "pid": s.pid, "tid": s.tid,
                       "ts": us(s.start_s), "args": {"request_id": s.request_id, **s.attrs}})
            continue
        key = (s.pid, s.tid, s.name, s.start_s, s.end_s)
        e = merged.get(key)
        if e is None:
            args = {"request_ids": [s.request_id], "frame_index": s.frame_index, "num_frames": s.num_frames}
            if s.cpu_ms == s.cpu_ms:  # not NaN
                args["cpu_ms"] = round(s.cpu_ms, 3)
            args.update({k: v for k, v in s.attrs.items() if isinstance(v, (int, float, str, bool))})
            merged[key] = {"ph": "X", "cat": s.stage, "name": s.name, "pid": s.pid, "tid": s.tid,
                           "ts": us(s.start_s), "dur": round(1e6 * (s.end_s - s.start_s), 3), "args": args}
        else:
            e["args"]["request_ids"].append(s.request_id)
    ev.extend(merged.values())

    for r in trace.thread_samples:
        iv = float(r.get("interval_ms") or 0.0)
        if iv > 0:
            ev.append({"ph": "C", "name": f"cpu % {r.get('thread', '')} ({r['tid']})", "pid": int(r["pid"]),
                       "tid": int(r["tid"]), "ts": us(r["t_s"]), "args": {"cpu": round(100 * r["cpu_ms"] / iv, 1)}})
    if trace.core_samples:
        ev.append({"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "machine (all processes)"}})
        for r in trace.core_samples:
            ev.append({"ph": "C", "name": f"core {r['core']} busy %", "pid": 0, "tid": 0, "ts": us(r["t_s"]),
                       "args": {"busy": round(100 * r["busy"], 1)}})
    return ev


def cpu_by_stage(trace: "Trace"):
    """Thread CPU time (ms) attributed to the stage running in that process at each sample.

    A sample interval of process P goes to the top-level span of P (talker ``step``, ``code2wav_chunk``,
    client work) that covers the interval's midpoint; ``"idle"`` when none does. Processes without
    spans (stage workers) keep their ``role``. Approximate at the sampling resolution. Columns: pid, tid,
    thread, role, stage, cpu_ms, wait_ms."""
    import pandas as pd

    cols = ["pid", "tid", "thread", "role", "stage", "cpu_ms", "wait_ms"]
    if not trace.thread_samples:
        return pd.DataFrame(columns=cols)
    index: dict[int, tuple[np.ndarray, np.ndarray, list[str]]] = {}
    tops: dict[tuple, tuple[float, float, str]] = {}
    for s in trace.spans:
        if s.name in _TOP_LEVEL:
            tops[(s.pid, s.start_s, s.end_s)] = (s.start_s, s.end_s, _TOP_LEVEL[s.name])
    by_pid: dict[int, list[tuple[float, float, str]]] = {}
    for (pid, _, _), v in tops.items():
        by_pid.setdefault(pid, []).append(v)
    for pid, v in by_pid.items():
        v.sort()
        index[pid] = (np.array([a for a, _, _ in v]), np.array([b for _, b, _ in v]), [c for _, _, c in v])
    rows = []
    for r in trace.thread_samples:
        pid = int(r["pid"])
        stage = r.get("role", "")
        if pid in index:
            starts, ends, labels = index[pid]
            mid = r["t_s"] - float(r.get("interval_ms", 0.0)) / 2e3
            i = int(np.searchsorted(starts, mid, side="right")) - 1
            stage = labels[i] if i >= 0 and ends[i] >= mid else "idle"
        rows.append((pid, int(r["tid"]), r.get("thread", ""), r.get("role", ""), stage,
                     float(r["cpu_ms"]), float(r.get("wait_ms", 0.0))))
    df = pd.DataFrame(rows, columns=cols)
    return df.groupby(cols[:5], as_index=False)[["cpu_ms", "wait_ms"]].sum()
