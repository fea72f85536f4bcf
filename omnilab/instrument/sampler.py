"""Per-thread and per-core CPU sampler over ``/proc`` (Linux), run on a background thread.

Contract: ``ThreadSampler.add_process(pid, role)`` registers processes (default: this one, role
"client"); between ``start()`` and ``stop()`` a daemon thread wakes every ``interval_s`` and appends rows:

- thread rows (only threads that ran or waited for a CPU in the interval; idle threads cost one read
  and add no row): ``t_s`` (perf_counter at the sample), ``interval_ms``, ``pid``, ``tid``, ``role`` (the
  process's stage), ``thread`` (Python thread name in this process, else ``comm``), ``cpu_ms`` (on-CPU
  time in the interval, ``/proc/<pid>/task/<tid>/schedstat``, ns precision), ``wait_ms`` (time runnable but
  waiting for a CPU: contention), ``user_ms``/``sys_ms`` (10 ms tick resolution), ``core`` (CPU it last ran
  on), ``affinity`` (its allowed CPUs, e.g. "0-1"), ``omp`` (the process's OpenMP/torch thread settings);
- core rows: ``t_s``, ``interval_ms``, ``core``, ``busy`` (0..1, machine-wide ``/proc/stat``: every process);
- process rows: ``t_s``, ``pid``, ``role``, ``rss_mb``, ``peak_rss_mb`` (``VmHWM``), ``num_threads``.

The first sample after ``start`` only sets baselines. The sampler times itself (``overhead()``) and keeps
its CPU under ``budget`` (default 0.5 % of one core): when a sample costs more than ``budget x
interval_s`` (many worker threads), the next one waits longer (at most 10 x ``interval_s``). A process whose CPU ticks did not move
since the last sample is skipped without reading its threads.
Processes that exit are dropped silently. No torch import (reads ``torch.get_num_threads`` only if torch
is already imported).
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Any

_OMP_KEYS = ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY",
             "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")
_TICK_MS = 1e3 / os.sysconf("SC_CLK_TCK")
_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def cpu_list(cpus) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def omp_tag(pid: int) -> str:
    """OpenMP-related settings of a process: its initial environment, plus torch threads for this one."""
    parts = []
    try:
        env = dict(kv.split(b"=", 1) for kv in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in kv)
        parts = [f"{k}={env[k.encode()].decode()}" for k in _OMP_KEYS if k.encode() in env]
    except OSError:
        pass
    if pid == os.getpid() and "torch" in sys.modules:
        parts.append(f"torch_threads={sys.modules['torch'].get_num_threads()}")
    return " ".join(parts)


def _schedstat(pid: int, tid: int) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting) of one thread; (-1, -1) without schedstats."""
    try:
        run, wait = _read(f"/proc/{pid}/task/{tid}/schedstat").split()[:2]
        return int(run), int(wait)
    except (ValueError, IndexError):
        return -1, -1


def _stat(pid: int, tid: int) -> tuple[int, int, int]:
    """(utime ticks, stime ticks, CPU it last ran on) of one thread."""
    raw = _read(f"/proc/{pid}/task/{tid}/stat")
    rest = raw[raw.rfind(b")") + 2:].split()
    return int(rest[11]), int(rest[12]), int(rest[36])


def _process_ticks(pid: int) -> int:
    """utime + stime of a whole process (all threads, 10 ms ticks): unchanged = idle since last read."""
    raw = _read(f"/proc/{pid}/stat")
    rest = raw[raw.rfind(b")") + 2:].split()
    return int(rest[11]) + int(rest[12])


def _core_times() -> dict[int, tuple[int, int]]:
    """core -> (busy ticks, total ticks) from /proc/stat."""
    out = {}
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"cpu") and line[3:4].isdigit():
                p = line.split()
                v = [int(x) for x in p[1:9]]
                idle = v[3] + v[4]
                out[int(p[0][3:])] = (sum(v) - idle, sum(v))
    return out


class ThreadSampler:
    """Samples the registered processes; see the module docstring for the rows."""

    def __init__(self, interval_s: float = 0.05, cores: bool = True, max_rows: int = 2_000_000,
                 budget: float = 0.005):
        if interval_s <= 0 or not 0 < budget <= 1:
            raise ValueError(f"interval_s must be > 0 and budget in (0, 1]; got {interval_s}, {budget}")
        self.interval_s = float(interval_s)
        self.budget = float(budget)
        self._last_cost_s = 0.0
        self.cores = cores
        self.procs: dict[int, dict[str, Any]] = {}
        self.threads: collections.deque = collections.deque(maxlen=max_rows)
        self.core_rows: collections.deque = collections.deque(maxlen=max_rows)
        self.proc_rows: collections.deque = collections.deque(maxlen=max_rows)
        self._prev: dict[tuple[int, int], tuple] = {}
        self._prev_cores: dict[int, tuple[int, int]] = {}
        self._prev_t: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._self_cpu_s = 0.0
        self._num_samples = 0
        self._active_s = 0.0
        self._t_started = 0.0
        self._lock = threading.Lock()
        self._sample_lock = threading.Lock()
        self.sampler_tid: int | None = None

    def add_process(self, pid: int, role: str) -> None:
        p = self.procs.get(pid)
        if p is None:
            self.procs[pid] = {"role": role, "omp": omp_tag(pid)}
        else:
            p["role"] = role

    @property
    def num_rows(self) -> int:
        return len(self.threads)

    # ---- one sample ------------------------------------------------------------------------------
    def sample_once(self) -> None:
        """Read every thread of every process (and the cores); append rows for the elapsed interval.
        Thread-safe: the background thread and a request's end (``ThreadUsageHook.collect``) both call it."""
        with self._sample_lock:
            self._sample()

    def _sample(self) -> None:
        c0 = time.thread_time()
        t = time.perf_counter()
        iv_ms = 1e3 * (t - self._prev_t) if self._prev_t is not None else 0.0
        names = {th.native_id: th.name for th in threading.enumerate()}
        me = os.getpid()
        seen: set[tuple[int, int]] = set()
        for pid, info in list(self.procs.items()):
            try:
                ticks = _process_ticks(pid)
                if self._prev_t is not None and ticks == info.get("ticks"):
                    seen.update(k for k in self._prev if k[0] == pid)  # idle process: skip its threads
                    self._process_row(t, pid, info)
                    continue
                info["ticks"] = ticks
                tids = [int(x) for x in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                self.procs.pop(pid, None)
                continue
            for tid in tids:
                key = (pid, tid)
                prev = self._prev.get(key)
                try:
                    run, wait = _schedstat(pid, tid)
                    if prev is not None and run >= 0 and (run, wait) == prev[2:]:
                        seen.add(key)  # idle since the last sample: no row, no further reads
                        continue
                    ut, st, core = _stat(pid, tid)
                    aff = cpu_list(os.sched_getaffinity(tid))
                except OSError:  # the thread exited
                    continue
                seen.add(key)
                self._prev[key] = (ut, st, run, wait)
                if self._prev_t is None:
                    continue
                pu, ps, pr, pw = prev if prev is not None else (0, 0, 0, 0)
                name = names.get(tid) if pid == me else None
                if name is None:
                    name = info.setdefault("names", {}).get(tid)
                    if name is None:
                        try:
                            name = _read(f"/proc/{pid}/task/{tid}/comm").decode().strip()
                        except OSError:
                            name = ""
                        name = ("main:" if tid == pid else "") + name
                        info["names"][tid] = name
                cpu = (run - pr) / 1e6 if run >= 0 else (ut - pu + st - ps) * _TICK_MS
                self.threads.append({
                    "t_s": t, "interval_ms": iv_ms, "pid": pid, "tid": tid, "role": info["role"], "thread": name,
                    "cpu_ms": cpu, "wait_ms": (wait - pw) / 1e6 if wait >= 0 else 0.0,
                    "user_ms": (ut - pu) * _TICK_MS, "sys_ms": (st - ps) * _TICK_MS, "core": core,
                    "affinity": aff, "omp": info["omp"]})
            if self._prev_t is not None:
                self._process_row(t, pid, info)
        for k in [k for k in self._prev if k not in seen]:
            del self._prev[k]
        if self.cores:
            cur = _core_times()
            if self._prev_t is not None:
                for core, (busy, total) in cur.items():
                    pb, pt = self._prev_cores.get(core, (busy, total))
                    d = total - pt
                    self.core_rows.append({"t_s": t, "interval_ms": iv_ms, "core": core,
                                           "busy": (busy - pb) / d if d > 0 else 0.0})
            self._prev_cores = cur
        self._prev_t = t
        self._num_samples += 1
        self._last_cost_s = time.thread_time() - c0
        self._self_cpu_s += self._last_cost_s

    def _process_row(self, t: float, pid: int, info: dict) -> None:
        try:
            status = open(f"/proc/{pid}/status", "rb").read()
        except OSError:
            return
        vals = {}
        for line in status.splitlines():
            if line[:6] in (b"VmRSS:", b"VmHWM:") or line.startswith(b"Threads:"):
                k, v = line.split(b":", 1)
                vals[k.decode()] = int(v.split()[0])
        self.proc_rows.append({"t_s": t, "pid": pid, "role": info["role"], "rss_mb": vals.get("VmRSS", 0) / 1024,
                               "peak_rss_mb": vals.get("VmHWM", 0) / 1024, "num_threads": vals.get("Threads", 0)})

    # ---- background thread -----------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            if not self.procs:
                self.add_process(os.getpid(), "client")
            self._prev_t = None
            self.sample_once()  # baselines (a full read of every thread: not a typical sample's cost)
            self._last_cost_s = 0.0
            self._stop.clear()
            self._t_started = time.perf_counter()
            self._thread = threading.Thread(target=self._run, name="omnilab-sampler", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        self.sampler_tid = threading.get_native_id()
        nxt = time.perf_counter()
        while not self._stop.is_set():
            # stretch the period when one sample costs more than the budget (many worker threads)
            nxt += min(max(self.interval_s, self._last_cost_s / self.budget), 10 * self.interval_s)
            delay = nxt - time.perf_counter()
            if delay < 0:  # fell behind (busy machine): skip missed ticks instead of bursting
                nxt = time.perf_counter()
                delay = 0.0
            if self._stop.wait(delay):
                break
            self.sample_once()

    def stop(self) -> None:
        with self._lock:
            th, self._thread = self._thread, None
            if th is None:
                return
            self._stop.set()
            th.join()
            self.sample_once()  # close the last interval
            self._active_s += time.perf_counter() - self._t_started

    @property
    def running(self) -> bool:
        return self._thread is not None

    # ---- results ---------------------------------------------------------------------------------
    def rows(self, t0_s: float | None = None, t1_s: float | None = None) -> dict[str, list[dict]]:
        def pick(rows):
            return [r for r in list(rows) if (t0_s is None or r["t_s"] >= t0_s) and (t1_s is None or r["t_s"] <= t1_s)]
        return {"thread_samples": pick(self.threads), "core_samples": pick(self.core_rows),
                "process_samples": pick(self.proc_rows)}

    def overhead(self) -> dict[str, float]:
        active = self._active_s + (time.perf_counter() - self._t_started if self.running else 0.0)
        n = max(self._num_samples, 1)
        return {"samples": self._num_samples, "sampler_cpu_ms": 1e3 * self._self_cpu_s,
                "ms_per_sample": 1e3 * self._self_cpu_s / n, "active_ms": 1e3 * active,
                "cpu_fraction": self._self_cpu_s / active if active > 0 else 0.0}

    def clear(self) -> None:
        """Drop the rows and restart the overhead counters (baselines are kept)."""
        self._self_cpu_s, self._num_samples, self._active_s = 0.0, 0, 0.0
        self._t_started = time.perf_counter()
        self.threads.clear()
        self.core_rows.clear()
        self.proc_rows.clear()
