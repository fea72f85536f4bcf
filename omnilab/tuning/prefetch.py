"""The quantized GEMV's software-prefetch distances, timed on this machine (cached), or the prior.

Why: ``qgemv.cpp`` prefetches a fixed distance ahead in each thread's stream of codes, and the best distance
depends on the CPU (figures per machine: docs/kernels.md#quantized-gemv-prefetch-distance). So the distance is
measured, per kind of call (:data:`SLOTS`), over the candidates :data:`CANDIDATES`.

:func:`measure` streams :data:`TIMING_MIB` of codes (above a VM's slice of L3, as a decode step reads DRAM) through
the kernel for each slot and candidate, rounds interleaved, best of each. The choice keeps the prior unless a
candidate is more than :data:`MARGIN` faster. Cached in ``$OMNILAB_CACHE/timing/qgemv-prefetch-<key>.json`` keyed
like the path timing (CPU model and flags, torch, the kernel build, threads); a timing taken while this process
waited on the run queue for more than ``NOISY_WAIT`` of its CPU time is used by this process only. It runs when the
kernel is resolved (at model load), under ``OMNILAB_PLAN_TIMING`` (``off``: the prior, no timing).
``OMNILAB_QGEMV_PREFETCH``: ``auto`` (default), one number of bytes for every slot, or three comma-separated
(one row int8 activations, rows int8 activations, fp32 activations); 0 turns prefetching off.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from omnilab import settings
from omnilab.errors import ConfigError
from omnilab.paths import cache_dir
from omnilab.profiles.timing import NOISY_WAIT
from omnilab.tuning.timing_key import _key, _schedstat, cached, timing_mode

ENV = "OMNILAB_QGEMV_PREFETCH"
SLOTS = ("one_row_int8_act", "rows_int8_act", "fp32_act")
# What each slot is timed on: (bits, rows, activations: qgemv.cpp's act, 0 fp32 / 1 int8 / 2 int16): the one-row
# slot on int8 weights with int16 activations (the decode row of most bytes: the code predictor in both the int8 and
# the int4 recipe), int4 at 4 rows with int8 activations, int8 weights with fp32 activations.
SLOT_CASES = {"one_row_int8_act": (8, 1, 2), "rows_int8_act": (4, 4, 1), "fp32_act": (8, 1, 0)}
PRIOR = (0, 2048, 2048)  # measured on Zen 4 (qgemv.cpp's defaults)
CANDIDATES = (0, 1024, 2048, 4096, 8192)
MAX_BYTES = 65536
MARGIN = 0.03
TIMING_MIB = 192
SHAPES = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))  # a 0.6B talker layer's fused decode matrices
ROUNDS = 3


@dataclass(frozen=True)
class Prefetch:
    """Distances in bytes per slot (:data:`SLOTS` order), and why."""
    distances: tuple[int, int, int]
    reason: str
    source: str  # "prior" | "timing" | "cached" | "env"


def parse(raw: str) -> tuple[int, int, int] | None:
    """``OMNILAB_QGEMV_PREFETCH``'s value -> distances, None for ``auto``; a bad value is a ConfigError."""
    raw = raw.strip().lower()
    if raw in ("", "auto"):
        return None
    parts = [p.strip() for p in raw.split(",")]
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        vals = []
    if len(vals) == 1:
        vals *= 3
    if len(vals) != 3 or any(v < 0 or v > MAX_BYTES or v % 64 for v in vals):
        raise ConfigError(f"{ENV}={raw!r}; accepted: auto, or one or three (comma-separated: {', '.join(SLOTS)}) "
                          f"byte distances, each 0 (off) or a multiple of 64 up to {MAX_BYTES}")
    return tuple(vals)  # type: ignore[return-value]


def _operands(bits: int, mib: int):
    """Packed codes and scales for whole layers of :data:`SHAPES` up to ``mib`` (the values do not matter: the
    kernel's time does not depend on them)."""
    per_layer = sum(n * k for n, k in SHAPES) * bits // 8
    layers = max(1, mib * 2**20 // per_layer)
    mats = []
    for _ in range(layers):
        for n, k in SHAPES:
            gs = 128 if bits == 4 else k
            w = torch.empty(n * k * bits // 8, dtype=torch.uint8).fill_(0x5A)
            s = torch.full((n * (k // gs),), 1e-3, dtype=torch.float16 if bits == 4 else torch.float32)
            mats.append((w, s, n, k, gs))
    return mats


def measure(fn, set_prefetch, threads: int, mib: int = TIMING_MIB) -> tuple[dict[str, dict[int, float]], float]:
    """ms per sweep for every slot and candidate (rounds interleaved, best of each), and the run-queue wait share.
    ``fn``: the loaded ``omnilab_qgemv``; ``set_prefetch``: ``omnilab_qgemv_set_prefetch``."""
    start = _schedstat()
    out: dict[str, dict[int, float]] = {}
    try:
        for slot, (bits, rows, act) in SLOT_CASES.items():
            mats = _operands(bits, mib)
            xs = {k: torch.randn(rows, k) for k in {k for _, _, _, k, _ in mats}}
            ys = {n: torch.empty(rows, n) for n in {n for _, _, n, _, _ in mats}}
            i = SLOTS.index(slot)

            def sweep():
                t0 = time.perf_counter()
                for w, s, n, k, gs in mats:
                    fn(xs[k].data_ptr(), w.data_ptr(), s.data_ptr(), int(s.dtype == torch.float16), None,
                       ys[n].data_ptr(), rows, n, k, bits, gs, act, threads)
                return 1e3 * (time.perf_counter() - t0)

            times = out.setdefault(slot, {})
            sweep()  # pages touched, threads started
            for _ in range(ROUNDS):
                for d in CANDIDATES:
                    set_prefetch(*[d if j == i else -1 for j in range(3)])
                    ms = sweep()
                    times[d] = min(ms, times.get(d, ms))
            del mats
    finally:
        set_prefetch(*PRIOR)
    run, wait = (b - a for a, b in zip(start, _schedstat()))
    return out, wait / max(run, 1)


def choose(times: dict[str, dict[int, float]]) -> tuple[tuple[int, int, int], str]:
    """The prior's distance per slot unless a candidate is more than :data:`MARGIN` faster (then the fastest)."""
    picked, notes = [], []
    for i, slot in enumerate(SLOTS):
        t = times[slot]
        best = min(t, key=t.get)
        prior = PRIOR[i]
        d = best if t[best] < t.get(prior, float("inf")) * (1 - MARGIN) else prior
        picked.append(d)
        notes.append(f"{slot} {d} ({', '.join(f'{c}: {ms:.1f}' for c, ms in sorted(t.items()))} ms)")
    return tuple(picked), "; ".join(notes)  # type: ignore[return-value]


def resolve(lib, threads: int | None = None) -> Prefetch:
    """The distances for this process (env, cache, timing or prior), set in ``lib`` (a loaded qgemv library)."""
    given = settings.raw(ENV) or ""
    fixed = parse(given)
    if fixed is not None:
        p = Prefetch(fixed, f"{ENV}={given.strip()}", "env")
    elif timing_mode() == "off":
        p = Prefetch(PRIOR, "the prior (measured on Zen 4): OMNILAB_PLAN_TIMING=off", "prior")
    else:
        p = _timed(lib, threads or torch.get_num_threads(), timing_mode() == "refresh")
    if lib.set_prefetch(*p.distances):
        raise RuntimeError(f"omnilab_qgemv_set_prefetch rejected {p.distances}")
    return p


def _timed(lib, threads: int, refresh: bool) -> Prefetch:
    key, parts = _key(threads, str(lib.path))

    def load(d):
        times = {s: {int(c): float(ms) for c, ms in d["times"][s].items()} for s in SLOTS}
        return times, d["measured"], d.get("wait_share", 0.0)

    def run():
        times, wait = measure(lib.fn, lib.set_prefetch, threads)
        return (times, None, wait), {"times": times}, wait

    (times, when, wait), from_cache = cached(cache_dir() / "timing" / f"qgemv-prefetch-{key}.json", refresh, load,
                                             run, parts)
    dist, why = choose(times)
    if from_cache:
        return Prefetch(dist, f"cached timing of {when} ({threads} threads): {why}", "cached")
    note = "" if wait <= NOISY_WAIT else (f" (run-queue wait {100 * wait:.0f} % of CPU time: used by this process "
                                          "only, not cached)")
    return Prefetch(dist, f"timed now ({threads} threads){note}: {why}", "timing")
