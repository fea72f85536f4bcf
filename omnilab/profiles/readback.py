"""Apply a profile to a stage worker process, and read back what a worker actually runs with.

Contract: ``apply_to_current_process(profile, stage)`` is what a stage worker of one's own calls first thing
(before importing torch or vLLM): it sets the stage's environment (``profile.to_env(stage)``, the same values
the pipeline starts its workers with) and CPU affinity, and sets torch's thread count when torch is already
imported. ``read_process(pid)`` reads a process's affinity mask (``os.sched_getaffinity``), its threads
(``/proc/<pid>/task``), each thread's mask and the ``OMP_NUM_THREADS`` it was started with;
``process_environ(pid)`` is the whole environment it was started with (``/proc/<pid>/environ``).
``compare_process`` lists every difference from the plan (empty list = matches). ``check_stages`` (what
``pipe.check_profile()`` returns) checks each stage where it runs: worker processes by their read-back (every
tensor-parallel talker rank against its own CPU list), a stage in this process by its torch threads. Linux only;
stdlib only (torch only inside ``check_stages``, already imported there).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from omnilab.errors import WorkerError
from omnilab.hardware import format_cpulist, parse_cpulist
from omnilab.profiles.profile import DeployProfile


@dataclass(frozen=True)
class ProcessReadback:
    pid: int
    cpus: tuple[int, ...]                    # process (main thread) affinity mask
    num_threads: int                         # entries in /proc/<pid>/task
    thread_cpus: tuple[tuple[int, ...], ...]  # each thread's affinity mask
    omp_num_threads: int | None              # OMP_NUM_THREADS from the start environment, if readable
    reported_threads: int | None = None      # what the worker says (e.g. torch.get_num_threads()), if given

    @property
    def pinned_cpus(self) -> tuple[int, ...]:
        """CPUs that some thread is pinned to alone (OpenMP threads bound one per CPU)."""
        return tuple(sorted({t[0] for t in self.thread_cpus if len(t) == 1}))

    def __repr__(self) -> str:
        return (f"ProcessReadback(pid={self.pid}, cpus={format_cpulist(self.cpus)!r}, threads={self.num_threads}, "
                f"pinned={format_cpulist(self.pinned_cpus)!r}, OMP_NUM_THREADS={self.omp_num_threads})")


def _thread_mask(status: str) -> tuple[int, ...]:
    for line in status.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpulist(line.partition(":")[2])
    return ()


def read_process(pid: int, *, reported_threads: int | None = None, proc: str = "/proc") -> ProcessReadback:
    """Read back affinity and threads of ``pid`` (``WorkerError`` if the process is gone)."""
    try:
        cpus = tuple(sorted(os.sched_getaffinity(pid)))
        tids = sorted(os.listdir(f"{proc}/{pid}/task"), key=int)
    except (ProcessLookupError, FileNotFoundError):
        raise WorkerError(f"process {pid} does not exist (the stage worker exited?)") from None
    masks = []
    for tid in tids:
        try:
            masks.append(_thread_mask(Path(f"{proc}/{pid}/task/{tid}/status").read_text()))
        except OSError:  # the thread ended while we looked
            continue
    omp = None
    try:
        omp = int(process_environ(pid, proc=proc).get("OMP_NUM_THREADS") or 0) or None
    except (OSError, ValueError):
        pass
    return ProcessReadback(pid, cpus, len(tids), tuple(masks), omp, reported_threads)


def process_environ(pid: int, *, proc: str = "/proc") -> dict[str, str]:
    """The environment ``pid`` was started with (``/proc/<pid>/environ``; ``OSError`` if unreadable). Compare
    it with ``profile.to_env(stage)``: the pipeline starts its workers with those values."""
    out = {}
    for item in Path(f"{proc}/{pid}/environ").read_bytes().split(b"\0"):
        key, eq, value = item.partition(b"=")
        if eq:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def compare_process(profile: DeployProfile, stage: str, readback: ProcessReadback, *, rank: int = 0) -> list[str]:
    """Differences between the plan for ``stage`` (rank ``rank``) and what the process runs with."""
    want = set(profile.cpus(stage, rank))
    threads = profile.threads(stage)
    out = []
    union = {c for mask in readback.thread_cpus for c in mask} or set(readback.cpus)
    if union != want:
        out.append(f"{stage}: threads may run on CPUs {format_cpulist(union)!r}, plan says {format_cpulist(want)!r}")
    pinned = readback.pinned_cpus
    if pinned and not set(pinned) <= want:
        out.append(f"{stage}: threads pinned to CPUs {format_cpulist(pinned)!r} outside the plan {format_cpulist(want)!r}")
    if pinned and len(pinned) != threads and len(pinned) > 1:
        out.append(f"{stage}: {len(pinned)} CPUs have a pinned thread, plan says {threads} OpenMP threads")
    if readback.omp_num_threads is not None and readback.omp_num_threads != threads:
        out.append(f"{stage}: started with OMP_NUM_THREADS={readback.omp_num_threads}, plan says {threads}")
    if readback.reported_threads is not None and readback.reported_threads != threads:
        out.append(f"{stage}: worker reports {readback.reported_threads} intra-op threads, plan says {threads}")
    if readback.num_threads < 1:
        out.append(f"{stage}: process {readback.pid} has no threads")
    return out


def check_process(profile: DeployProfile, stage: str, pid: int, *, rank: int = 0,
                  reported_threads: int | None = None) -> ProcessReadback:
    """``read_process`` + ``compare_process``; raises ``WorkerError`` listing every difference."""
    rb = read_process(pid, reported_threads=reported_threads)
    diffs = compare_process(profile, stage, rb, rank=rank)
    if diffs:
        raise WorkerError(f"stage worker pid {pid} does not match the deploy profile: " + "; ".join(diffs))
    return rb


def apply_to_current_process(profile: DeployProfile, stage: str, *, rank: int = 0) -> dict[str, str]:
    """Set this process's environment and affinity for ``stage``; returns the environment applied.
    Call it before importing torch: ``OMP_NUM_THREADS`` is read once, when the OpenMP runtime starts.
    (``LD_PRELOAD`` only takes effect in processes started afterwards: pass ``to_env`` to the spawn.)"""
    env = profile.to_env(stage)
    os.environ.update({k: v for k, v in env.items() if k != "LD_PRELOAD"})
    os.sched_setaffinity(0, profile.cpus(stage, rank))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(profile.threads(stage))
    return env


def check_stages(profile, processes: dict[int, str], info: dict[str, Any],
                 not_applied: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """Compare each stage with ``profile`` where it runs: a worker process (``processes`` role == stage) by
    reading back its affinity and threads (``info[stage]()`` reports its torch threads); a stage in this
    process by the torch threads it runs with (the talker: this process's; code2wav: what its stage reports
    for its calls). Raises ``WorkerError`` naming every difference. Returns ``{stage: ProcessReadback |
    threads}`` plus ``"not_applied": {field: reason}`` for what the placement cannot honour."""
    import torch

    roles = {role: pid for pid, role in processes.items()}
    out: dict[str, Any] = {}
    diffs: list[str] = []
    for rank in range(1, profile.talker_tp_size.value):  # rank 0 is the "talker" role below
        pid = roles.get(f"talker-rank{rank}")
        try:
            if pid is None:
                raise WorkerError(f"talker rank {rank} of {profile.talker_tp_size.value} has no process")
            out[f"talker-rank{rank}"] = check_process(profile, "talker", pid, rank=rank)
        except WorkerError as e:
            diffs.append(str(e))
    for stage in ("talker", "code2wav"):
        fn = info.get(stage)
        if stage in roles:
            try:
                out[stage] = check_process(profile, stage, roles[stage],
                                           reported_threads=fn()["torch_threads"] if fn else None)
            except WorkerError as e:
                diffs.append(str(e))
            continue
        got = torch.get_num_threads()
        if stage == "code2wav" and fn is not None:
            got = fn()["torch_threads"]
        want = profile.threads(stage)
        if got != want:
            diffs.append(f"{stage} runs in this process with {got} torch threads; the profile says {want}")
        out[stage] = got
    if diffs:
        raise WorkerError("; ".join(diffs))
    out["not_applied"] = dict(not_applied)
    return out
