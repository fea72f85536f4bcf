"""What a cached timing on this machine is keyed on, how noisy it was, the ``OMNILAB_PLAN_TIMING`` mode, and the cache
file itself (:func:`cached`): shared by the path timing (:mod:`omnilab.tuning.timing`) and the quantized GEMV's
prefetch timing (:mod:`omnilab.tuning.prefetch`), which must not import each other (the GEMV modules import the
prefetch)."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from omnilab import settings
from omnilab.errors import ConfigError
from omnilab.hardware import cpu_flags
from omnilab.paths import file_lock
from omnilab.profiles.timing import NOISY_WAIT, TIMING_ENV, TIMING_MODES


def timing_mode(env: str | None = None) -> str:
    raw = ((settings.raw(TIMING_ENV) or "") if env is None else env).strip().lower() or "auto"
    if raw not in TIMING_MODES:
        raise ConfigError(f"{TIMING_ENV}={raw!r}; accepted: {', '.join(TIMING_MODES)}")
    return raw


def _key(threads: int, library: str | None = None) -> tuple[str, dict]:
    model = ""
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith(("model name", "Model"))), "")
    except OSError:
        pass
    parts = {"cpu": model, "flags": hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12],
             "torch": torch.__version__, "gemv": Path(library or "torch").name, "threads": threads}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16], parts


def _schedstat() -> tuple[int, int]:
    """(ns on CPU, ns waiting on a run queue) summed over this process's threads (0, 0 where unreadable)."""
    run = wait = 0
    for task in Path("/proc/self/task").glob("*/schedstat"):
        try:
            a, b, *_ = task.read_text().split()
        except (OSError, ValueError):
            continue
        run, wait = run + int(a), wait + int(b)
    return run, wait


def cached(path: Path, refresh: bool, load: Callable[[dict], Any], measure: Callable[[], tuple[Any, dict, float]],
           parts: dict) -> tuple[Any, bool]:
    """``(value, from_cache)``: ``load(entry)`` of the JSON file at ``path`` unless ``refresh`` (a damaged entry is
    measured again), else ``measure()`` -> ``(value, record, wait_share)``, whose ``record`` is written (with
    ``parts``, the wait share and the date) only when the run-queue wait stayed within ``NOISY_WAIT``: a figure taken
    under other load is used by this process only. Under a file lock: concurrent processes measure once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_suffix(".lock")):
        if path.is_file() and not refresh:
            try:
                return load(json.loads(path.read_text())), True
            except (ValueError, KeyError, TypeError, AttributeError):
                pass
        value, record, wait = measure()
        if wait <= NOISY_WAIT:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**record, "parts": parts, "wait_share": wait,
                                       "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}))
            tmp.replace(path)
        return value, False
