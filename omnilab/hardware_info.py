"""Hardware data model and formatting: what a probe found, and how it is shown.

Contract: frozen dataclasses ``Core``, ``NumaNode`` and ``HardwareInfo`` (derived views are
properties; nothing here is a decision), kernel CPU-list syntax (``parse_cpulist`` /
``format_cpulist``) and ``native_bf16(flags, arch)``. Pure
functions over values: it reads no files (probing lives in ``omnilab.hardware``, which re-exports
these names). Stdlib only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from omnilab.html_tables import html_table

GiB = 1 << 30
X86_ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
ARM_ISA = ("asimd", "sve", "sve2", "i8mm", "bf16", "svebf16")


# ---------------------------------------------------------------- CPU list syntax ("0-3,8,10-11")
def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse kernel CPU-list syntax (``"0-3,8"``) into sorted ids. Raises ``ValueError`` naming it."""
    out: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not N or N-M") from None
        if a < 0 or b < a:
            raise ValueError(f"bad CPU list {text!r}: range {part!r}")
        out.update(range(a, b + 1))
    return tuple(sorted(out))


def format_cpulist(cpus: Iterable[int]) -> str:
    """Inverse of ``parse_cpulist``: ``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    ids, parts = sorted(set(cpus)), []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


# ---------------------------------------------------------------- data model
@dataclass(frozen=True)
class Core:
    """One physical core: its socket, NUMA node and SMT siblings (``cpus[0]`` is the primary)."""
    socket: int
    node: int
    core_id: int
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]                 # online logical CPUs of the node
    mem_total_bytes: int | None
    mem_available_bytes: int | None       # MemFree + FilePages + SReclaimable (node files lack MemAvailable)


@dataclass(frozen=True)
class HardwareInfo:
    """What ``probe_hardware`` found. Derived views are properties; nothing here is a decision."""
    source: str
    arch: str
    model_name: str
    flags: frozenset[str]
    online_cpus: tuple[int, ...]
    affinity_cpus: tuple[int, ...]
    cores: tuple[Core, ...]
    nodes: tuple[NumaNode, ...]
    mem_total_bytes: int
    mem_available_bytes: int
    cgroup_version: str = "none"
    cpu_quota: float | None = None                 # CPUs' worth of time per period, None = unlimited
    cgroup_memory_limit_bytes: int | None = None
    cgroup_memory_usage_bytes: int | None = None
    tcmalloc_path: str | None = None
    iomp5_path: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def isa(self) -> tuple[str, ...]:
        return tuple(f for f in (ARM_ISA if self.is_arm else X86_ISA) if f in self.flags)

    @property
    def is_arm(self) -> bool:
        return self.arch in ("aarch64", "arm64")

    @property
    def num_sockets(self) -> int:
        return len({c.socket for c in self.cores}) or 1

    @property
    def threads_per_core(self) -> int:
        return max((len(c.cpus) for c in self.cores), default=1)

    @property
    def usable_cpus(self) -> tuple[int, ...]:
        """Online CPUs in this process's affinity mask (the cgroup cpuset is already applied there)."""
        mask = set(self.affinity_cpus)
        return tuple(c for c in self.online_cpus if c in mask)

    @property
    def usable_cores(self) -> tuple[Core, ...]:
        """Physical cores with at least one usable CPU; ``cpus`` restricted to usable ones."""
        mask, out = set(self.usable_cpus), []
        for c in self.cores:
            cpus = tuple(x for x in c.cpus if x in mask)
            if cpus:
                out.append(Core(c.socket, c.node, c.core_id, cpus))
        return tuple(out)

    @property
    def cpu_limit(self) -> float:
        """CPUs' worth of compute this process may use: usable CPUs, capped by the cgroup quota."""
        n = float(len(self.usable_cpus))
        return min(n, self.cpu_quota) if self.cpu_quota else n

    @property
    def memory_available_bytes(self) -> int:
        """MemAvailable, capped by the cgroup's limit minus its usage."""
        avail = self.mem_available_bytes
        if self.cgroup_memory_limit_bytes is not None:
            avail = min(avail, self.cgroup_memory_limit_bytes - (self.cgroup_memory_usage_bytes or 0))
        return max(0, avail)

    def node_memory(self, node_id: int) -> tuple[int | None, int | None]:
        """``(total, available)`` bytes of NUMA node ``node_id`` as vLLM's CPU worker sees them: the node's
        meminfo, both clamped by the cgroup memory limit (minus its usage for ``available``) when that is
        smaller; ``(None, None)`` for an unknown node or a machine without per-node meminfo."""
        node = next((n for n in self.nodes if n.id == node_id), None)
        total, avail = (node.mem_total_bytes, node.mem_available_bytes) if node else (None, None)
        limit = self.cgroup_memory_limit_bytes
        if limit is not None and total is not None and limit < total:
            total = limit
            if avail is not None:
                avail = max(0, min(avail, limit - (self.cgroup_memory_usage_bytes or 0)))
        return total, avail

    def node_of(self, cpu: int) -> int:
        for n in self.nodes:
            if cpu in n.cpus:
                return n.id
        return 0

    def native_bf16(self) -> tuple[bool, str]:
        return native_bf16(self.flags, self.arch)

    def summary(self) -> dict[str, str]:
        cores, quota = self.usable_cores, self.cpu_quota
        rows = {
            "source": self.source, "arch": self.arch, "model": self.model_name or "?",
            "ISA": ", ".join(self.isa) or "(none of interest)",
            "native bf16": self.native_bf16()[1],
            "sockets": str(self.num_sockets),
            "NUMA nodes": "; ".join(f"node{n.id}: {format_cpulist(n.cpus)}" for n in self.nodes),
            "SMT": f"{self.threads_per_core} thread(s) per core",
            "online CPUs": format_cpulist(self.online_cpus),
            "affinity mask": format_cpulist(self.affinity_cpus),
            "usable": f"{len(self.usable_cpus)} CPUs on {len(cores)} physical cores",
            "cgroup": f"{self.cgroup_version}; CPU quota "
                      + (f"{quota:g} CPUs" if quota else "none") + "; memory limit "
                      + (_gib(self.cgroup_memory_limit_bytes) if self.cgroup_memory_limit_bytes else "none"),
            "memory": f"{_gib(self.mem_total_bytes)} total, {_gib(self.mem_available_bytes)} available, "
                      f"{_gib(self.memory_available_bytes)} usable",
            "memory per node": "; ".join(f"node{n.id}: {_gib(n.mem_total_bytes)} total, "
                                         f"{_gib(n.mem_available_bytes)} available" for n in self.nodes),
            "libtcmalloc": self.tcmalloc_path or "not found",
            "libiomp5": self.iomp5_path or "not found",
        }
        if self.notes:
            rows["notes"] = "; ".join(self.notes)
        return rows

    def to_dict(self) -> dict:
        return {"summary": self.summary(), "usable_cpus": list(self.usable_cpus),
                "cores": [[c.socket, c.node, c.core_id, list(c.cpus)] for c in self.cores],
                "cpu_limit": self.cpu_limit, "memory_available_bytes": self.memory_available_bytes}

    def __repr__(self) -> str:
        quota = f" (cgroup quota {self.cpu_quota:g})" if self.cpu_quota else ""
        return (f"HardwareInfo({self.arch}, {len(self.usable_cpus)}/{len(self.online_cpus)} CPUs usable{quota}, "
                f"{self.num_sockets} socket(s), {len(self.nodes)} NUMA node(s), SMT {self.threads_per_core}, "
                f"{'/'.join(self.isa[-2:]) or 'no SIMD flags'}, {_gib(self.memory_available_bytes)} usable)")

    def __str__(self) -> str:
        rows = self.summary()
        width = max(map(len, rows))
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows.items())

    def _repr_html_(self) -> str:
        return html_table(["property", "value"], list(self.summary().items()))


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.1f} GiB"


# ---------------------------------------------------------------- ISA and bf16
def native_bf16(flags: frozenset[str] | set[str], arch: str) -> tuple[bool, str]:
    """``(has_bf16, reason)`` from cpuinfo flags: avx512_bf16/amx_bf16 on x86, bf16 on aarch64."""
    if arch.lower() in ("aarch64", "arm64"):
        ok = "bf16" in flags
        return ok, "aarch64 bf16 extension " + ("present" if ok else "absent")
    found = sorted(set(flags) & {"avx512_bf16", "amx_bf16"})
    if found:
        return True, f"x86 with {', '.join(found)}"
    return False, "x86 without avx512_bf16/amx_bf16: bf16 would be emulated (about 3x slower than fp32 here)"


# ---- which build of omnilab's kernels a CPU gets (plain: `omnilab plan` says it without torch; kernels/ build them)
def select_isa(flags: frozenset[str] | set[str]) -> tuple[str | None, str]:
    """``(isa, reason)`` for the CPU flags: avx512 with ``avx512f``, avx2 with ``avx2`` + ``fma``, else None."""
    if "avx512f" in flags:
        return "avx512", "CPU has avx512f (16-lane fp32 FMA)"
    if {"avx2", "fma"} <= set(flags):
        return "avx2", "CPU has avx2 + fma (8-lane fp32 FMA), no avx512f"
    return None, "CPU has neither avx512f nor avx2 + fma"


def avx512_without_vnni(flags: frozenset[str] | set[str]) -> bool:
    """The quantized GEMV's avx512 build uses ``vpdpbusd``: such a CPU runs its avx2 build."""
    return "avx512f" in flags and "avx512_vnni" not in flags


def kernel_isas(flags: frozenset[str] | set[str]) -> dict[str, str]:
    """The build of each omnilab kernel ``auto`` picks on a CPU with ``flags`` (before any override or build)."""
    isa = select_isa(flags)[0]
    q = "avx2" if isa == "avx512" and avx512_without_vnni(flags) else isa
    name = lambda i, note="": f"omnilab-{i}{note}" if i else "torch (no avx512f / avx2 + fma)"  # noqa: E731
    return {"GEMV (decode linears)": name(isa), "quantized GEMV (int8/int4)": name(q, " (vpdpbusd)" if q == "avx512"
            else " (vpmaddubsw)" if q else ""), "SnakeBeta (code2wav)": name(isa)}
