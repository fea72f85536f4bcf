"""Decode weights in transparent huge pages: one anonymous mapping, ``madvise(MADV_HUGEPAGE)``.

Why: a decode step streams every talker and code-predictor matrix once per frame (6.6 GB at 0.6B fp32).
With 4 KiB pages that is a TLB miss every 4 KiB. In isolation, GEMVs over the code predictor's matrices
ran 5-7 % faster from 2 MiB pages here (paired medians of 40 alternations, 2 threads); whole decode steps
did not (interleaved pipelines, x0.97-1.05 over 6 rounds each, within this shared host's noise). So it is
opt-in: ``OMNILAB_HUGEPAGES=on`` (or ``auto``: on where THP allows it) places the streamed matrices
(``talker_streamed_name``) in one arena at load; the ``Parameter`` objects, names and values are unchanged.

Choice (:func:`hugepages_choice`), with a reason; ``OMNILAB_HUGEPAGES=off|on|auto``: ``off`` (default)
keeps torch's allocations; ``on`` raises if transparent huge pages are unavailable
(``/sys/kernel/mm/transparent_hugepage/enabled`` must be ``always`` or ``madvise``); ``auto`` uses them
where available.
"""
from __future__ import annotations

import math
import mmap
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from omnilab import settings
from omnilab.errors import ConfigError
from omnilab.tuning.storage import talker_streamed_name

ENV = "OMNILAB_HUGEPAGES"
MODES = ("off", "on", "auto")
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"
ALIGN_BYTES = 4096  # each tensor starts on a page (SIMD loads aligned, no false sharing between tensors)
HUGE_BYTES = 2 << 20

@dataclass(frozen=True)
class HugepagesChoice:
    enabled: bool
    reason: str
    source: str  # "default" | "env"

    @property
    def label(self) -> str:
        return "transparent huge pages (madvise)" if self.enabled else "torch allocations"


def _thp_mode(path: str = THP_SYSFS) -> str | None:
    """``always`` / ``madvise`` / ``never`` (the bracketed word of the sysfs file), None if absent."""
    try:
        m = re.search(r"\[(\w+)\]", Path(path).read_text())
    except OSError:
        return None
    return m.group(1) if m else None


def hugepages_choice(env: str | None = None, thp: str | None = "probe") -> HugepagesChoice:
    given = ((settings.raw(ENV) or "") if env is None else env).strip().lower()
    raw = given or "off"
    if raw not in MODES:
        raise ConfigError(f"{ENV}={raw!r} is not a mode; accepted: {', '.join(MODES)}")
    source = "env" if given else "default"
    if raw == "off":
        why = f"{ENV}=off" if given else (f"default (opt in with {ENV}=on): 2 MiB pages sped up isolated GEMVs "
                                          f"by 5-7 % but not whole decode steps here")
        return HugepagesChoice(False, why, source)
    mode = _thp_mode() if thp == "probe" else thp
    usable = mode in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")
    what = f"transparent huge pages are {mode!r} ({THP_SYSFS})" if mode else f"no {THP_SYSFS} (not Linux THP)"
    if not usable:
        if raw == "on":
            raise RuntimeError(f"{ENV}=on needs transparent huge pages ('always' or 'madvise'); {what}")
        return HugepagesChoice(False, f"{what}: decode weights stay in torch's allocations", source)
    reason = f"{ENV}={raw}: {what}: decode weights in one madvise(MADV_HUGEPAGE) mapping"
    return HugepagesChoice(True, reason, source)


class WeightArena:
    """A fixed-size anonymous mapping, madvised for huge pages, handed out as page-aligned tensors.

    Tensors from :meth:`put` keep the mapping alive (``torch.frombuffer`` holds the buffer)."""

    def __init__(self, nbytes: int):
        size = max(HUGE_BYTES, -(-int(nbytes) // HUGE_BYTES) * HUGE_BYTES)
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.nbytes, self.used = size, 0

    @staticmethod
    def size_for(tensors: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
        return sum(_aligned(math.prod(s) * d.itemsize) for s, d in tensors)

    @property
    def address(self) -> int:
        return self._bytes.data_ptr()

    def put(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A copy of ``t`` inside the arena, cast to ``dtype`` (default: ``t``'s) while copying."""
        dtype = dtype or t.dtype
        n = t.numel() * dtype.itemsize
        if self.used + n > self.nbytes:
            raise RuntimeError(f"weight arena full: {self.used} + {n} > {self.nbytes} bytes")
        out = self._bytes[self.used:self.used + n].view(dtype).view(t.shape)
        out.copy_(t)
        self.used += _aligned(n)
        return out

    def __contains__(self, t: torch.Tensor) -> bool:
        return self.address <= t.data_ptr() < self.address + self.nbytes

    def __repr__(self) -> str:
        return f"WeightArena({self.used / 2**30:.2f} of {self.nbytes / 2**30:.2f} GiB)"


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def plan_arena(expected: dict[str, tuple[tuple[int, ...], torch.dtype]], streamed) -> tuple[WeightArena | None, set[str]]:
    """For a loader: the arena for the keys of ``expected`` (name -> (shape, stored dtype)) that
    ``streamed(name)`` selects; ``(None, set())`` when ``streamed`` is None or selects nothing."""
    if streamed is None:
        return None, set()
    keys = {k for k, (shape, _) in expected.items() if len(shape) == 2 and streamed(k)}
    if not keys:
        return None, set()
    return WeightArena(WeightArena.size_for([expected[k] for k in keys])), keys


def pack(module: torch.nn.Module, streamed=talker_streamed_name) -> WeightArena | None:
    """Move ``module``'s already-loaded parameters that ``streamed(name)`` selects (2-D) into a new arena,
    in place (``Parameter`` objects and values unchanged); returns it (None if nothing is selected).
    For models built without the loaders (benchmarks, notebooks)."""
    params = [(n, p) for n, p in module.named_parameters() if p.dim() == 2 and streamed(n)]
    if not params:
        return None
    arena = WeightArena(WeightArena.size_for([(tuple(p.shape), p.dtype) for _, p in params]))
    with torch.no_grad():
        for _, p in params:
            p.data = arena.put(p.data)
    module.weight_arena = arena
    return arena
