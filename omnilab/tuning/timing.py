"""A short timing of the linear paths on this machine, cached, and the process's choice of paths from it.

:func:`path_times` times, over the same bf16 decode matrices (:data:`LAYER_SHAPES` of a 0.6B talker layer, repeated
to :data:`TIMING_MIB` so the pass streams from DRAM as a decode step does), each candidate at 1 and 4 rows:
``fp32-kernel`` (fp32 activations over bf16 storage, omnilab's GEMV kernel: fp32 compute's decode path),
``bf16-torch`` (torch's bf16 GEMV), ``bf16-kernel`` (bf16 activations widened, the same kernel, rounded back),
and a :data:`PREFILL_ROWS`-row prefill as ``fp32`` (matrix widened) and ``bf16`` (bf16 GEMM). About 2-4 s, once per
machine: the result is cached in ``$OMNILAB_CACHE/timing/paths-<key>.json``, keyed on the CPU model and flags, the
torch version, the GEMV kernel build (its library file name carries the source + compiler hash) and the thread
count, so a change of any of them measures again; a timing taken while other load kept this process waiting on the
run queue for more than :data:`NOISY_WAIT` of its CPU time is used by this process only, not cached.
``OMNILAB_PLAN_TIMING=auto|on`` (use / measure), ``refresh`` (measure again), ``off`` (no timing: the ISA rule). The rules that turn times into choices are plain Python in
:mod:`omnilab.profiles.timing`.

:func:`linear_paths` is the process's choice for :func:`omnilab.kernels.linear`: bf16 compute's 1-16-row linears
(``OMNILAB_BF16_DECODE=auto|kernel|torch``) and fp32 compute's prefill GEMMs over bf16 matrices
(``OMNILAB_PREFILL_GEMM=auto|fp32|bf16``), each with its reason. Worker processes resolve the same choice from the
same cache file and variables.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnilab import settings
from omnilab.errors import ConfigError
from omnilab.hardware import cpu_has_native_bf16
from omnilab.kernels.gemv import _SLOT, _call, gemv_choice, install_paths  # the kernel the timing runs and keys on
from omnilab.paths import cache_dir
from omnilab.profiles.timing import PathTimes, bf16_decode_from_times, dtype_from_times, prefill_from_times
from omnilab.tuning.timing_key import _key, _schedstat, cached, timing_mode

LAYER_SHAPES = ((2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024), (1024, 3072))
TIMING_MIB = 256      # above a desktop/VM slice of L3: the pass reads DRAM (0.6B talker step: ~880 MiB in bf16)
PREFILL_ROWS = 64
REPS = 2
BF16_DECODE_ENV, PREFILL_ENV = "OMNILAB_BF16_DECODE", "OMNILAB_PREFILL_GEMM"


def _best_ms(fn, reps: int = REPS) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def measure(threads: int | None = None, mib: int | None = None, lib=None, call=None) -> PathTimes:
    """Time every candidate now (see the module docstring); nothing is cached. ``lib`` / ``call``: the loaded GEMV
    kernel and its entry (``omnilab.kernels.gemv``; None: torch only, the ``bf16-kernel`` candidate left out)."""
    mib = TIMING_MIB if mib is None else mib
    threads = threads or torch.get_num_threads()
    old, start = torch.get_num_threads(), _schedstat()
    torch.set_num_threads(threads)
    try:
        per_layer = sum(n * k for n, k in LAYER_SHAPES) * 2
        layers = max(1, mib * 2**20 // per_layer)
        ws = [torch.empty(s, dtype=torch.bfloat16).uniform_(-0.05, 0.05) for _ in range(layers) for s in LAYER_SHAPES]
        decode: dict[str, dict[int, float]] = {}
        for rows in (1, 4):
            x32 = {k: torch.randn(rows, k) for k in {s[1] for s in LAYER_SHAPES}}
            xb = {k: v.bfloat16() for k, v in x32.items()}
            cands = {"bf16-torch": lambda: [F.linear(xb[w.shape[1]], w) for w in ws]}
            if lib is not None:
                cands["fp32-kernel"] = lambda: [call(lib, x32[w.shape[1]], w, None, rows) for w in ws]
                cands["bf16-kernel"] = lambda: [call(lib, xb[w.shape[1]].float(), w, None, rows).bfloat16() for w in ws]
            else:  # no kernel: an fp32 talker keeps fp32 copies (tuning.storage), so its decode is MKL over them
                wf = [w.float() for w in ws]
                cands["fp32-kernel"] = lambda: [F.linear(x32[w.shape[1]], w) for w in wf]
            for _ in range(2):  # two alternated rounds: the best of each candidate
                for name, fn in cands.items():
                    ms = _best_ms(fn)
                    decode.setdefault(name, {})[rows] = min(ms, decode.get(name, {}).get(rows, ms))
        few = ws[:len(LAYER_SHAPES)]
        xp = {k: torch.randn(PREFILL_ROWS, k) for k in {s[1] for s in LAYER_SHAPES}}
        xpb = {k: v.bfloat16() for k, v in xp.items()}
        prefill = {"fp32": _best_ms(lambda: [F.linear(xp[w.shape[1]], w.float()) for w in few]),
                   "bf16": _best_ms(lambda: [F.linear(xpb[w.shape[1]], w).float() for w in few])}
        nbytes = sum(w.numel() * 2 for w in ws)
        del ws
    finally:
        torch.set_num_threads(old)
    run, wait = (b - a for a, b in zip(start, _schedstat()))
    return PathTimes(decode, prefill, nbytes, PREFILL_ROWS, threads, extra={"wait_share": wait / max(run, 1)})


_MEMO: dict[str, PathTimes] = {}


def path_times(threads: int | None = None, env: str | None = None) -> PathTimes | None:
    """The cached timing for this machine (measured on first use), or None under ``OMNILAB_PLAN_TIMING=off``."""
    mode = timing_mode(env)
    if mode == "off":
        return None

    threads = threads or torch.get_num_threads()
    key, parts = _key(threads, gemv_choice().library)
    if key in _MEMO and mode != "refresh":
        return _MEMO[key]

    def run():
        got = measure(threads, lib=_SLOT.loaded(), call=_call)
        times = PathTimes(got.decode, got.prefill, got.matrix_bytes, got.prefill_rows, threads, key, extra=got.extra)
        return times, {**times.to_dict(), **got.extra}, got.extra.get("wait_share", 0)

    times, _ = cached(cache_dir() / "timing" / f"paths-{key}.json", mode == "refresh",
                      lambda d: PathTimes.from_dict(d, cached=True), run, parts)
    _MEMO[key] = times
    return times


def auto_dtype() -> tuple[str, str]:
    """``(dtype name, reason)`` for ``dtype="auto"`` without a profile: the planner's rule over this timing."""
    return dtype_from_times(*cpu_has_native_bf16(), path_times())


@dataclass(frozen=True)
class LinearPaths:
    """Which path :func:`omnilab.kernels.linear` takes for bf16 decode rows and fp32 prefills, and why."""
    bf16_decode: str       # "kernel" | "torch"
    prefill: str           # "fp32" | "bf16"
    reason: str
    source: str            # "auto" | "env" | "off" (timing off: the ISA rule)

    @property
    def label(self) -> str:
        return f"bf16 decode: {self.bf16_decode}, fp32-compute prefill: {self.prefill} GEMM"


def _env_choice(var: str, accepted: tuple[str, ...]) -> str | None:
    raw = (settings.raw(var) or "").strip().lower()
    if raw and raw not in accepted + ("auto",):
        raise ConfigError(f"{var}={raw!r}; accepted: auto, {', '.join(accepted)}")
    return None if raw in ("", "auto") else raw


def resolve_paths() -> LinearPaths:
    dec_env, pre_env = _env_choice(BF16_DECODE_ENV, ("kernel", "torch")), _env_choice(PREFILL_ENV, ("fp32", "bf16"))
    times = None if dec_env and pre_env else path_times()
    native = cpu_has_native_bf16()[0]
    dec, dwhy = (dec_env, f"{BF16_DECODE_ENV}={dec_env}") if dec_env else bf16_decode_from_times(times)
    pre, pwhy = (pre_env, f"{PREFILL_ENV}={pre_env}") if pre_env else prefill_from_times(native, times)
    source = "env" if dec_env or pre_env else ("off" if times is None else "auto")
    return LinearPaths(dec, pre, f"bf16 decode: {dwhy}; prefill: {pwhy}", source)


_PATHS: list[LinearPaths] = []


def linear_paths() -> LinearPaths:
    """The process's choice (resolved, timing included, on first use) and installed in ``kernels.linear``; the
    talker's loader calls it (client and worker processes), so no step pays for the timing."""
    if not _PATHS:
        _PATHS.append(resolve_paths())
        install_paths(_PATHS[0])
    return _PATHS[0]


def reset() -> None:
    """Forget the process's choice (tests, the bench's per-configuration environments): back to the ISA prior."""
    _PATHS.clear()
    install_paths(None)
