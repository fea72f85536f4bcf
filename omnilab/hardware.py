"""Hardware probe: ISA flags, sockets / NUMA / SMT topology, usable CPUs, cgroup limits, memory.

Contract: ``probe_hardware(root="/")`` reads plain text files only (``/proc/cpuinfo``,
``/proc/meminfo``, ``/proc/self/{status,cgroup,mountinfo}``, ``/proc/sys/kernel/arch``,
``/sys/devices/system/{cpu,node}``, cgroup v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``/
``memory.limit_in_bytes``/``memory.usage_in_bytes`` and v2 ``cpu.max``/``memory.max``/
``memory.current``) and returns a frozen ``HardwareInfo``. ``root`` is ``"/"`` (this machine), a
directory holding a copied tree, or a ``.json`` snapshot ``{"files": {"/abs/path": "text"}}`` as
written by ``snapshot_hardware()``; tests point it at fixtures. It decides nothing: sizing lives in
``omnilab.profiles``. Stdlib only.

``cpu_has_native_bf16()`` is the one fact the model loader needs: bf16 is used only where the CPU
computes it natively (avx512_bf16 or AMX on x86, the bf16 extension on aarch64).

The data model and formatting (``HardwareInfo``, ``parse_cpulist``, ``native_bf16``, ...) live in
``omnilab.hardware_info`` and are re-exported here.
"""
from __future__ import annotations

import json
import os
import platform
import sys
from functools import lru_cache
from pathlib import Path
from typing import Mapping

from omnilab.hardware_info import (ARM_ISA, X86_ISA, Core, GiB, HardwareInfo, NumaNode,  # noqa: F401
                                   format_cpulist, html_table, native_bf16, parse_cpulist)

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
