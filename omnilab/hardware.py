"""The machine: what a probe finds (ISA flags, sockets / NUMA / SMT topology, usable CPUs, cgroup limits, memory),
its data model and how it is shown.

Contract: ``probe_hardware(root="/")`` reads plain text files only (``/proc/cpuinfo``, ``/proc/meminfo``,
``/proc/self/{status,cgroup,mountinfo}``, ``/proc/sys/kernel/arch``, ``/sys/devices/system/{cpu,node}``, cgroup v1
``cpu.cfs_quota_us``/``cpu.cfs_period_us``/``memory.limit_in_bytes``/``memory.usage_in_bytes`` and v2
``cpu.max``/``memory.max``/``memory.current``) and returns a frozen ``HardwareInfo``. ``root`` is ``"/"`` (this
machine), a directory holding a copied tree, or a ``.json`` snapshot ``{"files": {"/abs/path": "text"}}`` as written
by ``snapshot_hardware()``; tests point it at fixtures. The data model (``Core``, ``NumaNode``, ``HardwareInfo``: derived
views are properties), the kernel CPU-list syntax (``parse_cpulist`` / ``format_cpulist``) and ``native_bf16`` are pure
functions over values. It decides nothing: sizing lives in ``omnilab.profiles``. Stdlib only.

``cpu_has_native_bf16()`` is the one fact the model loader needs: bf16 is used only where the CPU computes it
natively (avx512_bf16 or AMX on x86, the bf16 extension on aarch64).
"""
from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping

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
    """The quantized GEMV's avx512 build uses ``vpdpbusd`` / ``vpdpwssd`` (VNNI) and 16-bit shifts (BW): a CPU with
    avx512f but not both runs its avx2 build."""
    return "avx512f" in flags and not {"avx512_vnni", "avx512bw"} <= set(flags)


def kernel_isas(flags: frozenset[str] | set[str]) -> dict[str, str]:
    """The build of each omnilab kernel ``auto`` picks on a CPU with ``flags`` (before any override or build)."""
    isa = select_isa(flags)[0]
    q = "avx2" if isa == "avx512" and avx512_without_vnni(flags) else isa
    name = lambda i, note="": f"omnilab-{i}{note}" if i else "torch (no avx512f / avx2 + fma)"  # noqa: E731
    dots = " (vpdpbusd, vpdpwssd)" if q == "avx512" else " (vpmaddubsw, vpmaddwd)" if q else ""
    return {"GEMV (decode linears)": name(isa), "quantized GEMV (int8/int4)": name(q, dots),
            "SnakeBeta (code2wav)": name(isa)}


_LIB_DIRS = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/lib/x86_64-linux-gnu",
             "/usr/lib/aarch64-linux-gnu", "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu")
_TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
_IOMP5 = ("libiomp5.so",)
_NO_LIMIT = 1 << 60  # cgroup v1 writes 9223372036854771712 for "unlimited"


# ---------------------------------------------------------------- file access (tree, snapshot, live)
class _Files:
    """Reads ``root``-relative absolute paths from a directory or a JSON snapshot; records reads."""

    def __init__(self, root: str | os.PathLike | Mapping[str, str]):
        self.log: dict[str, str] = {}
        self.map: dict[str, str] | None = None
        if isinstance(root, Mapping):
            self.map, self.name = dict(root.get("files", root)), "<mapping>"
        elif str(root).endswith(".json"):
            self.map, self.name = dict(json.loads(Path(root).read_text())["files"]), str(root)
        else:
            self.dir, self.name = Path(root), str(root)
        self.live = self.map is None and self.dir.resolve() == Path("/")

    def read(self, path: str) -> str | None:
        if self.map is not None:
            text = self.map.get(path)
        else:
            try:
                text = (self.dir / path.lstrip("/")).read_text(errors="replace")
            except OSError:
                text = None
        if text is not None:
            self.log[path] = text
        return text

    def exists(self, path: str) -> bool:
        ok = path in self.map if self.map is not None else (self.dir / path.lstrip("/")).exists()
        if ok:
            self.log.setdefault(path, "")
        return ok

    def listdir(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        if self.map is not None:
            return sorted({k[len(prefix):].split("/")[0] for k in self.map if k.startswith(prefix)})
        try:
            return sorted(os.listdir(self.dir / path.lstrip("/")))
        except OSError:
            return []


def _int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def _meminfo(text: str | None) -> dict[str, int]:
    """``/proc/meminfo`` or ``nodeN/meminfo`` -> bytes by key (``Node 0 MemTotal: 1 kB`` works too)."""
    out = {}
    for line in (text or "").splitlines():
        key, _, rest = line.partition(":")
        vals = rest.split()
        if vals and vals[0].isdigit():
            out[key.split()[-1]] = int(vals[0]) * (1024 if len(vals) > 1 and vals[1] == "kB" else 1)
    return out


# ---------------------------------------------------------------- ISA and bf16
def _flags_from_cpuinfo(text: str) -> frozenset[str]:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@lru_cache(maxsize=1)
def _cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> frozenset[str]:
    try:
        return _flags_from_cpuinfo(Path(cpuinfo_path).read_text())
    except OSError:
        return frozenset()


def cpu_flags() -> frozenset[str]:
    """The ``flags`` / ``Features`` words of /proc/cpuinfo for this machine (empty if unreadable)."""
    return _cpu_flags()


def cpu_has_native_bf16() -> tuple[bool, str]:
    """Return ``(has_bf16, reason)`` for the CPU this process runs on."""
    return native_bf16(_cpu_flags(), platform.machine().lower())


# ---------------------------------------------------------------- cgroups
def _cgroup_dirs(fs: _Files, controller: str) -> tuple[str, list[str]]:
    """(version, candidate dirs from this process's cgroup up to the mount) for ``cpu``/``memory``."""
    paths = {}
    for line in (fs.read("/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for ctl in (parts[1].split(",") if parts[1] else [""]):
                paths[ctl] = parts[2]
    mounts = []  # (version, mount point, mount root)
    for line in (fs.read("/proc/self/mountinfo") or "").splitlines():
        pre, _, post = line.partition(" - ")
        f, g = pre.split(), post.split()
        if len(f) >= 5 and g and g[0] == "cgroup2":
            mounts.append(("v2", f[4], f[3]))
        elif len(f) >= 5 and g and g[0] == "cgroup" and controller in g[-1].split(","):
            mounts.append(("v1", f[4], f[3]))
    if not mounts:  # no mountinfo (snapshots, minimal containers): conventional mount points
        for mp in (f"/sys/fs/cgroup/{controller}", f"/sys/fs/cgroup/{controller},cpuacct"):
            if fs.listdir(mp):
                mounts.append(("v1", mp, "/"))
        if fs.exists("/sys/fs/cgroup/cgroup.controllers"):
            mounts.append(("v2", "/sys/fs/cgroup", "/"))
    for version, mp, mroot in sorted(mounts, key=lambda m: m[0] != "v1"):
        own = paths.get(controller if version == "v1" else "", "/")
        if version == "v2" and not fs.exists(f"{mp}/cgroup.controllers"):
            continue
        dirs, rel = [mp], None
        if own.startswith(mroot):
            rel = own[len(mroot):].strip("/")
        if rel:
            parts = rel.split("/")
            dirs = [mp + "/" + "/".join(parts[:i]) for i in range(len(parts), 0, -1)] + [mp]
        return version, dirs
    return "none", []


def _read_cgroups(fs: _Files) -> tuple[str, float | None, int | None, int | None]:
    cpu_v, cpu_dirs = _cgroup_dirs(fs, "cpu")
    mem_v, mem_dirs = _cgroup_dirs(fs, "memory")
    quota = limit = usage = None
    for d in cpu_dirs:
        if cpu_v == "v2":
            q, p = ((fs.read(f"{d}/cpu.max") or "max 100000").split() + ["100000"])[:2]
            val = None if q == "max" else int(q) / int(p)
        else:
            q, p = _int(fs.read(f"{d}/cpu.cfs_quota_us")), _int(fs.read(f"{d}/cpu.cfs_period_us"))
            val = q / p if q is not None and q > 0 and p else None
        if val is not None:
            quota = val if quota is None else min(quota, val)
    for i, d in enumerate(mem_dirs):
        raw = fs.read(f"{d}/memory.max" if mem_v == "v2" else f"{d}/memory.limit_in_bytes")
        val = _int(raw) if raw and raw.strip() != "max" else None
        if val is not None and val < _NO_LIMIT:
            limit = val if limit is None else min(limit, val)
        if i == 0:
            usage = _int(fs.read(f"{d}/memory.current" if mem_v == "v2" else f"{d}/memory.usage_in_bytes"))
    versions = {v for v in (cpu_v, mem_v) if v != "none"}
    version = "none" if not versions else versions.pop() if len(versions) == 1 else "v1+v2"
    return version, quota, limit, (usage if limit is not None else None)


# ---------------------------------------------------------------- probe
def _find_lib(fs: _Files, names: tuple[str, ...]) -> str | None:
    dirs = list(_LIB_DIRS)
    if fs.live:  # the Python environment's own libs first (pip's intel-openmp, vLLM's bundled tcmalloc)
        site = Path(os.__file__).parent / "site-packages"
        dirs = [str(Path(sys.prefix) / "lib"), str(site / "vllm" / "libs"), str(site / "vllm.libs"),
                *os.environ.get("LD_LIBRARY_PATH", "").split(":"), *dirs]
    for d in filter(None, dirs):
        for n in names:
            if fs.exists(f"{d}/{n}"):
                return f"{d}/{n}"
    if fs.map is not None:  # a snapshot may hold the library anywhere (a venv, /opt/intel, ...)
        hits = sorted(k for k in fs.map if k.rsplit("/", 1)[-1] in names)
        return fs.exists(hits[0]) and hits[0] if hits else None
    return None


def probe_hardware(root: str | os.PathLike | Mapping[str, str] = "/", *, pid: int | None = None) -> HardwareInfo:
    """Describe the machine (or a fixture) at ``root``. ``pid`` picks whose affinity mask to read."""
    return _probe(_Files(root), pid)


def _probe(fs: _Files, pid: int | None) -> HardwareInfo:
    notes: list[str] = []
    cpuinfo = fs.read("/proc/cpuinfo") or ""
    flags = _flags_from_cpuinfo(cpuinfo)
    arch = (fs.read("/proc/sys/kernel/arch") or "").strip()
    if not arch:
        arch = platform.machine().lower() if fs.live else ("aarch64" if "CPU implementer" in cpuinfo else "x86_64")
    info = {ln.partition(":")[0].strip(): ln.partition(":")[2].strip() for ln in cpuinfo.split("\n\n")[0].splitlines()}
    model = info.get("model name") or (f"Arm implementer {info['CPU implementer']} part {info.get('CPU part', '?')}"
                                       if "CPU implementer" in info else "")
    online_txt = fs.read("/sys/devices/system/cpu/online")
    if online_txt:
        online = parse_cpulist(online_txt)
    else:
        online = tuple(sorted(int(d[3:]) for d in fs.listdir("/sys/devices/system/cpu")
                              if d.startswith("cpu") and d[3:].isdigit()))
        online = online or tuple(range(cpuinfo.count("processor\t:") or (os.cpu_count() if fs.live else 1) or 1))
        notes.append("no /sys/devices/system/cpu/online; CPU list inferred")
    node_cpus: dict[int, tuple[int, ...]] = {}
    nodes = []
    for d in fs.listdir("/sys/devices/system/node"):
        if d.startswith("node") and d[4:].isdigit():
            nid = int(d[4:])
            cpus = tuple(c for c in parse_cpulist(fs.read(f"/sys/devices/system/node/{d}/cpulist") or "")
                         if c in online)
            mi = _meminfo(fs.read(f"/sys/devices/system/node/{d}/meminfo"))
            avail = (mi["MemFree"] + mi.get("FilePages", 0) + mi.get("SReclaimable", 0)) if "MemFree" in mi else None
            if cpus:
                node_cpus[nid] = cpus
                nodes.append(NumaNode(nid, cpus, mi.get("MemTotal"),
                                      min(avail, mi["MemTotal"]) if avail is not None else None))
    if not nodes:
        notes.append("no /sys/devices/system/node; assuming one NUMA node")
        nodes = [NumaNode(0, online, None, None)]
        node_cpus = {0: online}
    cpu_node = {c: nid for nid, cs in node_cpus.items() for c in cs}
    groups: dict[tuple[int, ...], tuple[int, int]] = {}
    for cpu in online:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        sib = fs.read(f"{base}/thread_siblings_list") or fs.read(f"{base}/core_cpus_list")
        sibs = tuple(c for c in parse_cpulist(sib) if c in online) if sib else (cpu,)
        pkg = _int(fs.read(f"{base}/physical_package_id"))
        core = _int(fs.read(f"{base}/core_id"))
        groups.setdefault(sibs or (cpu,), (pkg if pkg is not None else 0, core if core is not None else cpu))
    cores = tuple(sorted((Core(pkg, cpu_node.get(s[0], 0), cid, s) for s, (pkg, cid) in groups.items()),
                         key=lambda c: c.cpus[0]))
    if fs.live:
        affinity = tuple(sorted(os.sched_getaffinity(pid or 0)))
    else:
        status = fs.read(f"/proc/{pid or 'self'}/status") or ""
        line = next((ln for ln in status.splitlines() if ln.startswith("Cpus_allowed_list:")), None)
        affinity = parse_cpulist(line.partition(":")[2]) if line else online
    mem = _meminfo(fs.read("/proc/meminfo"))
    version, quota, limit, usage = _read_cgroups(fs)
    return HardwareInfo(
        source="this machine" if fs.live else fs.name, arch=arch, model_name=model, flags=flags,
        online_cpus=online, affinity_cpus=affinity, cores=cores, nodes=tuple(sorted(nodes, key=lambda n: n.id)),
        mem_total_bytes=mem.get("MemTotal", 0), mem_available_bytes=mem.get("MemAvailable", mem.get("MemFree", 0)),
        cgroup_version=version, cpu_quota=quota, cgroup_memory_limit_bytes=limit, cgroup_memory_usage_bytes=usage,
        tcmalloc_path=_find_lib(fs, _TCMALLOC), iomp5_path=_find_lib(fs, _IOMP5), notes=tuple(notes))


def snapshot_hardware(root: str | os.PathLike = "/", *, pid: int | None = None) -> dict:
    """Every file ``probe_hardware`` read, as ``{"files": {path: text}}``; ``probe_hardware(snapshot)``
    gives the same result (in a snapshot the affinity mask comes from ``/proc/self/status``)."""
    fs = _Files(root)
    _probe(fs, pid)
    files = dict(fs.log)
    if fs.live:
        files["/proc/self/status"] = "Cpus_allowed_list:\t" + format_cpulist(os.sched_getaffinity(pid or 0)) + "\n"
        files["/proc/sys/kernel/arch"] = platform.machine().lower() + "\n"
    return {"files": files}
