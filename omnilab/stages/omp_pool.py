"""Release the calling thread's GNU OpenMP thread pool around the calls a pipeline's owner thread computes.

Why: GNU OpenMP (libgomp, the runtime torch's CPU wheels ship and omnilab's kernels run on) keeps one pool of
worker threads per thread that ever opened a parallel region. Once the workers of all pools outnumber the usable
CPUs (``gomp_managed_threads > gomp_available_cpus``), every waiting OpenMP thread spins only ~100 iterations
before it sleeps on a futex, in every pool, so each parallel region pays a wake-up; a talker step opens hundreds.
A pipeline computes on its owner thread (``stages/owner.py``), while the thread that called
``Pipeline.from_pretrained`` (loading, quantizing, timing on its own pool) keeps its pool: on two CPUs that is one
worker too many, and a step takes about twice as long (docs/reliability.md#threads-and-iterators).

``release_caller_pool()``: the owner thread's callers call it before they hand over a call, and the owner thread
after each call, so a pipeline that is not computing holds no pool: two pipelines side by side in one process (a
comparison, ``quality.compare``, the bench's interleaved rounds) each have an owner thread. It calls OpenMP 5.0's
``omp_pause_resource_all(omp_pause_soft)`` in libgomp, which frees the calling thread's pool (its workers exit; the
next parallel region on that thread starts a new one, a thread start or two). Only where libgomp is the process's
runtime and only outside a parallel region (libgomp then returns -1 and does nothing); LLVM/Intel OpenMP is left
alone (it has no such throttle; there a hard pause would end the runtime).

Which libgomp: the one loaded under the soname ``libgomp.so.1``, the runtime torch's wheel and omnilab's kernels
link against (``dlopen("libgomp.so.1", RTLD_NOLOAD)``), not the first ``libgomp*`` in ``/proc/self/maps``: wheels
vendor their own renamed copy (sentencepiece's ``sentencepiece.libs/libgomp-<hash>.so.1.0.0``, loaded with vLLM's
tokenizer stack), and pausing that copy returns 0 but frees nothing of torch's (what it cost a vLLM in-process
pipeline: docs/reliability.md#threads-and-iterators). ``OMNILAB_OMP_RELEASE=auto`` (default) | ``off``; another value
is a ``ConfigError`` naming the accepted ones.

May import: the standard library and ``omnilab.errors`` (``stages/owner.py`` imports it; no torch).
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

from omnilab import settings
from omnilab.errors import ConfigError

ENV = "OMNILAB_OMP_RELEASE"
MODES = ("auto", "off")
_PAUSE_SOFT = 1  # omp_pause_soft (OpenMP 5.0)
_lock = threading.Lock()
_pause = None       # the resolved omp_pause_resource_all, or False where there is none to call
_why = ""


def mode() -> str:
    given = settings.raw(ENV)
    raw = (given or "auto").strip().lower()
    if raw not in MODES:
        raise ConfigError(f"{ENV}={given!r}; accepted: {', '.join(MODES)}")
    return raw


SONAME = "libgomp.so.1"  # what torch's libtorch_cpu and omnilab's kernels (-fopenmp) name as their OpenMP runtime


def _mapped_libgomp() -> list[str]:
    """Paths of every libgomp mapped into this process (torch's, and any copy a wheel vendors), in map order."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()  # address perms offset dev inode [path]
                if len(parts) >= 6 and os.path.basename(parts[5]).startswith("libgomp") and parts[5] not in paths:
                    paths.append(parts[5])
    except OSError:
        pass
    return paths


def _runtime():
    """(library, description) of the libgomp loaded as ``libgomp.so.1``, or (None, why) where there is none."""
    paths = _mapped_libgomp()
    if not paths:
        return None, "no libgomp loaded in this process (no GNU OpenMP pools to release)"
    try:  # the object that holds the soname; RTLD_NOLOAD: never loads a runtime that is not there
        lib = ctypes.CDLL(SONAME, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None, f"no libgomp loaded as {SONAME} (only {', '.join(paths)}): not torch's runtime, left alone"
    own = [p for p in paths if os.path.basename(p) == SONAME]
    where = own[0] if len(own) == 1 else SONAME
    others = [p for p in paths if p not in own]
    return lib, where + (f"; not the vendored copies {', '.join(others)}" if others else "")


def _resolve():
    """(function or False, why): ``omp_pause_resource_all`` of torch's libgomp when it is loaded."""
    global _pause, _why
    with _lock:
        if _pause is None:
            lib, where = _runtime()
            if lib is None:
                if "torch" not in sys.modules:  # torch loads it: look again after its import, not on every call
                    return False, where
                _pause, _why = False, where
            else:
                fn = getattr(lib, "omp_pause_resource_all", None)
                if fn is None:
                    _pause, _why = False, f"libgomp ({where}) has no omp_pause_resource_all (OpenMP < 5.0)"
                else:
                    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                    _pause, _why = fn, f"libgomp ({where}): omp_pause_resource_all frees the caller's pool"
        return _pause, _why


def release_caller_pool() -> bool:
    """Free the calling thread's libgomp pool (see the module docstring). True when it was released (or there was
    none); False when off, when the process has no libgomp, or inside a parallel region."""
    if mode() == "off":
        return False
    fn, _ = _resolve()
    return bool(fn) and fn(_PAUSE_SOFT) == 0


def describe() -> str:
    """One line: what ``release_caller_pool`` does in this process, and why."""
    if mode() == "off":
        return f"off ({ENV}=off): the caller and the owner thread keep their OpenMP pools"
    return _resolve()[1]


__all__ = ["release_caller_pool", "describe", "mode", "ENV", "MODES"]
