"""What the benchmark's processes hold and wait for: peak resident memory and run-queue wait (Linux ``/proc``).

- ``ProcessSampler``: a background thread that samples, every ``interval_s`` (0.2 s), the RSS of this
  process and all its descendants (stage workers, vLLM's engine core): the peak of their sum
  (``peak_total_bytes``) and each process's peak (``peaks``, ``"pid:name" -> bytes``). Current RSS, not
  ``VmHWM``: a configuration measured after another in the same process is not charged the earlier
  one's lifetime peak (memory the allocator kept is still counted).
- ``mem_available_bytes`` (MemAvailable within the cgroup, from ``omnilab.hardware``) and ``tree_rss_bytes`` (the tree's current RSS): what ``--interleave``
  checks before it builds one more configuration side by side (``bench.modes``), and the reference row's check.
- ``schedstat_snapshot`` / ``wait_pct``: per thread of the same process tree, the CPU time and the time it
  was runnable but waited for a CPU (``/proc/<pid>/task/<tid>/schedstat``, ns). ``wait_pct(a, b)`` =
  wait / (CPU + wait) between two snapshots over the threads alive at both: the share of the run our
  threads spent queued behind other load. On a shared machine a figure above ~10 % means the timings
  of that window are inflated by other work (``omnilab bench`` flags it).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from omnilab.hardware import probe_hardware

Snapshot = dict[tuple[int, int], tuple[int, int]]  # (pid, tid) -> (cpu ns, run-queue wait ns)


def process_tree() -> list:
    """``psutil.Process`` of this process and its descendants (those that vanish are skipped later)."""
    import psutil

    me = psutil.Process()
    try:
        return [me] + me.children(recursive=True)
    except psutil.Error:
        return [me]


def schedstat_snapshot(pids: list[int] | None = None) -> Snapshot:
    """CPU and run-queue wait of every thread of ``pids`` (default: this process tree), in ns."""
    out: Snapshot = {}
    for pid in pids if pids is not None else [p.pid for p in process_tree()]:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                cpu, wait = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2]
            except (OSError, ValueError):
                continue
            out[(pid, int(tid))] = (int(cpu), int(wait))
    return out


def wait_pct(before: Snapshot, after: Snapshot) -> float | None:
    """Run-queue wait as % of (CPU + wait) between two snapshots (threads present in both); None if idle."""
    cpu = wait = 0
    for key, (c1, w1) in after.items():
        if key in before:
            c0, w0 = before[key]
            cpu, wait = cpu + max(c1 - c0, 0), wait + max(w1 - w0, 0)
    return 100.0 * wait / (cpu + wait) if cpu + wait else None


def mem_available_bytes(meminfo: str | None = None) -> int:
    """Bytes this process can still allocate: MemAvailable capped by the cgroup's room, as the planner reads it
    (``hardware.HardwareInfo.memory_available_bytes``). ``meminfo``: that file's MemAvailable instead (a test's);
    0 where it cannot be read."""
    if meminfo is None:
        return probe_hardware().memory_available_bytes
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return 0
    return probe_hardware({"/proc/meminfo": text}).memory_available_bytes


def rss_by_process() -> dict[str, int]:
    """Current RSS of this process tree, ``"pid:name"`` (``client`` for this process) -> bytes."""
    out, me = {}, os.getpid()
    for p in process_tree():
        try:
            out[f"{p.pid}:{'client' if p.pid == me else p.name()}"] = p.memory_info().rss
        except Exception:  # the process ended between listing and reading
            continue
    return out


def tree_rss_bytes() -> int:
    """The summed current RSS of this process and its descendants."""
    return sum(rss_by_process().values())


class ProcessSampler:
    """Peak RSS of this process tree, sampled in a thread while the ``with`` block runs (see the module doc)."""

    def __init__(self, interval_s: float = 0.2):
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s!r}; accepted: a positive number of seconds")
        self.interval_s = interval_s
        self.peak_total_bytes = 0
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        now = rss_by_process()
        for key, rss in now.items():
            self.peaks[key] = max(self.peaks.get(key, 0), rss)
        self.peak_total_bytes = max(self.peak_total_bytes, sum(now.values()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "ProcessSampler":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="omnilab-bench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def summary(self) -> dict:
        """``peak_rss_gib`` (sum over the tree) and ``peak_rss_gib_by_process``."""
        return {"peak_rss_gib": self.peak_total_bytes / 2**30,
                "peak_rss_gib_by_process": {k: round(v / 2**30, 3) for k, v in self.peaks.items()}}
