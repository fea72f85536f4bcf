"""Derived views of a ``Trace`` that need more than a table: Trace Event JSON for Perfetto, and thread CPU
attributed to the stage that was running. Plain Python + numpy/pandas; used by ``omnilab.instrument.trace``.

Trace Event rules kept here so Perfetto imports every slice (``slice_drop_overlapping_complete_event`` = 0):

- Times are whole nanoseconds after ``t0_s``: ``ts = round(start) / 1000`` us and ``dur = (round(end) -
  round(start)) / 1000`` us, so neighbouring spans that meet in the data meet in the file (rounding is
  monotone: nothing that nests or abuts in float seconds overlaps after it), and Perfetto's
  ``llround(us * 1000)`` reads back the same integers.
- On one ``(pid, tid)`` track, complete events (``X``) nest strictly or do not touch. A batched span shared by
  several requests is one event (``args.request_ids``); spans that still partially overlap on a thread go to
  an extra lane, a track of their own (``tid + lane * 2**22``, above every Linux tid, named
  ``"<thread> (<tid>) lane <k>"``). Events are written in ``(pid, tid, ts, -dur)`` order.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from omnilab.instrument.trace import Trace

# top-level work on a thread: what a CPU sample of that process is attributed to
_LANE_TID = 1 << 22  # pid_max on 64-bit Linux: synthetic lane tids sit above every real tid
_TOP_LEVEL = {"step": "talker", "code2wav_chunk": "code2wav", "admission": "client", "hop": "client",
              "consumer": "client"}


def _process_names(trace: "Trace") -> dict[int, str]:
    names = {int(k): str(v) for k, v in (trace.meta.get("processes") or {}).items()}
    for r in trace.thread_samples + trace.process_samples:
        names.setdefault(int(r["pid"]), str(r.get("role", "")))
    for s in trace.spans:
        names.setdefault(s.pid, s.stage)
    return names


def _lanes(events: list[dict[str, Any]]) -> dict[int, int]:
    """Lane per complete event of one track (0: the thread's own track) so that no lane holds two events
    that partially overlap; ``events`` carry integer ``_a``/``_b`` ns bounds and are sorted by (start, -dur)."""
    stacks: list[list[int]] = []
    lane: dict[int, int] = {}
    for i, e in enumerate(events):
        for k, st in enumerate(stacks):
            while st and st[-1] <= e["_a"]:
                st.pop()
            if not st or e["_b"] <= st[-1]:
                break
        else:
            k, st = len(stacks), []
            stacks.append(st)
        st.append(e["_b"])
        lane[i] = k
    return lane


def chrome_trace_events(trace: "Trace") -> list[dict[str, Any]]:
    """Trace Event format events (see ``Trace.to_chrome_trace`` and this module's rules)."""
    t0 = trace.t0_s
    ns = lambda t: int(round(1e9 * (t - t0)))  # noqa: E731
    us = lambda t: ns(t) / 1e3  # noqa: E731
    ev: list[dict[str, Any]] = []
    for pid, role in sorted(_process_names(trace).items()):
        ev.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                   "args": {"name": f"{role} (pid {pid})" if role else f"pid {pid}"}})
    threads: dict[tuple[int, int], str] = {}
    for r in trace.thread_samples:
        threads.setdefault((int(r["pid"]), int(r["tid"])), str(r.get("thread", "")))
    for s in trace.spans:
        threads.setdefault((s.pid, s.tid), "main" if s.pid == s.tid else "")

    merged: dict[tuple, dict[str, Any]] = {}
    for s in trace.spans:
        if s.name == "request":
            common = {"cat": "request", "name": f"request {s.request_id}", "id": str(s.request_id),
                      "pid": s.pid, "tid": s.tid}
            ev.append({**common, "ph": "b", "ts": us(s.start_s), "args": dict(s.attrs)})
            ev.append({**common, "ph": "e", "ts": us(s.end_s)})
            continue
        a, b = ns(s.start_s), ns(s.end_s)
        if b <= a:
            ev.append({"ph": "i", "s": "t", "cat": s.stage, "name": s.name, "pid": s.pid, "tid": s.tid,
                       "ts": a / 1e3, "args": {"request_id": s.request_id, **s.attrs}})
            continue
        key = (s.pid, s.tid, s.name, a, b)
        e = merged.get(key)
        if e is None:
            args = {"request_ids": [s.request_id], "frame_index": s.frame_index, "num_frames": s.num_frames}
            if s.cpu_ms == s.cpu_ms:  # not NaN
                args["cpu_ms"] = round(s.cpu_ms, 3)
            args.update({k: v for k, v in s.attrs.items() if isinstance(v, (int, float, str, bool))})
            merged[key] = {"ph": "X", "cat": s.stage, "name": s.name, "pid": s.pid, "tid": s.tid,
                           "ts": a / 1e3, "dur": (b - a) / 1e3, "args": args, "_a": a, "_b": b}
        else:
            e["args"]["request_ids"].append(s.request_id)
    by_track: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in merged.values():
        by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    complete: list[dict[str, Any]] = []
    for (pid, tid), evs in sorted(by_track.items()):
        evs.sort(key=lambda e: (e["_a"], -e["_b"]))
        lanes = _lanes(evs)
        for i, e in enumerate(evs):
            if lanes[i]:
                e["tid"] = tid + lanes[i] * _LANE_TID
                threads.setdefault((pid, e["tid"]), f"{threads.get((pid, tid)) or 'thread'} ({tid}) lane {lanes[i]}")
            del e["_a"], e["_b"]
        complete += sorted(evs, key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    for (pid, tid), name in sorted(threads.items()):
        label = name if tid >= _LANE_TID else f"{name or 'thread'} ({tid})"
        ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
    ev.extend(complete)

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
