"""Hardware probe (ISA flags, topology, memory). Stdlib only.

``cpu_has_native_bf16()`` is the one fact the model loader needs: bf16 is used only where the CPU
computes it natively (avx512_bf16 or AMX on x86, the bf16 extension on aarch64).
"""
from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def _cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> frozenset[str]:
    try:
        text = Path(cpuinfo_path).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_native_bf16() -> tuple[bool, str]:
    """Return ``(has_bf16, reason)`` for the CPU this process runs on."""
    flags = _cpu_flags()
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        ok = "bf16" in flags
        return ok, "aarch64 bf16 extension " + ("present" if ok else "absent")
    found = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if found:
        return True, f"x86 with {', '.join(found)}"
    return False, "x86 without avx512_bf16/amx_bf16: bf16 would be emulated (about 3x slower than fp32 here)"
