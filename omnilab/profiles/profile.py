"""``DeployProfile``: the resolved deployment of the two stages (talker, code2wav) on CPUs.

Contract: a frozen dataclass whose every decision is a ``Resolved(value, reason, source)``. It
validates its own consistency on construction (thread counts match CPU lists, split-mode lists are
disjoint, nothing runs on reserved CPUs) and against a machine with ``check(hardware)`` (CPUs inside
the affinity mask, KV budget under the available memory of the machine and of each talker NUMA node, where
vLLM allocates it). ``talker_pinned=False`` (``VLLM_CPU_OMP_THREADS_BIND=nobind``) means the talker's
threads are not pinned: its one CPU list is every CPU they may run on, ``talker_threads`` at most that
many. It renders what the stage workers need:
``to_env(stage)`` (``VLLM_CPU_OMP_THREADS_BIND``, ``OMP_NUM_THREADS``, ``LD_PRELOAD``, ...),
``engine_args(stage)`` and ``chunk_sizes(n)``. These are the one road to the processes: the pipeline's workers
start with exactly ``to_env(stage)`` and the talker engine is sized by ``engine_args("talker")``
(``omnilab.stages.vllm.deploy.VllmDeploy.from_profile``), the YAML export writes them, and a worker of one's
own applies them with ``readback.apply_to_current_process``. Planning lives in ``planner.py``, YAML in
``deploy_yaml.py``.
"""
from __future__ import annotations

import dataclasses
import html
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnilab.config import INT4_GROUP_SIZES
from omnilab.errors import ConfigError
from omnilab.hardware import GiB, format_cpulist
from omnilab.html_tables import html_table
from omnilab.profiles.cost import BLOCK_SIZE, StreamEstimate, chunk_schedule
from omnilab.profiles.deploy_yaml import profile_fields_from_yaml, profile_to_yaml
from omnilab.profiles.resolved import Resolved
from omnilab.profiles.tensor_parallel import shared_node_warning

if TYPE_CHECKING:
    from omnilab.hardware import HardwareInfo

STAGES = ("talker", "code2wav")
MODES = ("split", "shared")
DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("none", "int8") + tuple(f"{r}-g{g}" for r in ("int4", "int4-all") for g in INT4_GROUP_SIZES)


def _show(name: str, v: Any) -> str:
    if name == "talker_cpus":
        return " | ".join(format_cpulist(r) for r in v)
    if name in ("code2wav_cpus", "reserved_cpus"):
        return format_cpulist(v) or "-"
    if name == "kv_cache_bytes":
        return f"{v / GiB:.2f} GiB ({v} B)"
    if name == "chunk_ramp_frames":
        return ", ".join(map(str, v)) or "-"
    if name == "preload":
        return ":".join(v) or "-"
    return str(v)


@dataclass(frozen=True)
class DeployProfile:
    """Threads, CPU lists, KV budget, dtype, chunking and preload for the talker and code2wav stages."""
    name: str
    mode: Resolved[str]                               # "split": disjoint core sets; "shared": code2wav on talker cores
    talker_tp_size: Resolved[int]
    talker_threads: Resolved[int]                     # OpenMP threads per talker rank
    talker_cpus: Resolved[tuple[tuple[int, ...], ...]]  # one CPU list per tensor-parallel rank
    code2wav_threads: Resolved[int]
    code2wav_cpus: Resolved[tuple[int, ...]]
    reserved_cpus: Resolved[tuple[int, ...]]          # left to the notebook kernel / front-end
    dtype: Resolved[str]
    quantization: Resolved[str]                       # decode matrices: "none" | "int8" | "int4-g32/64/128"
    max_num_seqs: Resolved[int]
    max_model_len: Resolved[int]
    kv_cache_bytes: Resolved[int]
    first_chunk_frames: Resolved[int]
    chunk_ramp_frames: Resolved[tuple[int, ...]]      # chunk sizes after the first, before steady ones
    steady_chunk_frames: Resolved[int]
    preload: Resolved[tuple[str, ...]]                # LD_PRELOAD for the worker processes
    estimate: StreamEstimate | None = None
    memory_cap_bytes: int | None = None               # the KV cap the planner used, if planned here
    hardware: str = ""                                # where it was planned (one line)
    warnings: tuple[str, ...] = field(default=())
    talker_pinned: bool = True                        # False: VLLM_CPU_OMP_THREADS_BIND=nobind (see talker_cpus)

    def __post_init__(self):
        bad = [f.name for f in dataclasses.fields(self) if f.type.startswith("Resolved")
               and not (isinstance(getattr(self, f.name), Resolved) and getattr(self, f.name).reason)]
        if bad:
            raise ConfigError(f"DeployProfile fields without a Resolved value and reason: {', '.join(bad)}")
        v = self.values()
        if v["mode"] not in MODES:
            raise ConfigError(f"mode {v['mode']!r}; accepted: {', '.join(MODES)}")
        if v["dtype"] not in DTYPES:
            raise ConfigError(f"dtype {v['dtype']!r}; accepted: {', '.join(DTYPES)}")
        if v["quantization"] not in QUANTIZATIONS:
            raise ConfigError(f"quantization {v['quantization']!r}; accepted: {', '.join(QUANTIZATIONS)} "
                              f"(an int4 profile names its group)")
        for k in ("talker_tp_size", "talker_threads", "code2wav_threads", "max_num_seqs", "max_model_len",
                  "kv_cache_bytes", "first_chunk_frames", "steady_chunk_frames"):
            if not isinstance(v[k], int) or v[k] < 1:
                raise ConfigError(f"{k} must be a positive integer, got {v[k]!r}")
        if any(c < 1 for c in v["chunk_ramp_frames"]):
            raise ConfigError(f"chunk sizes must be >= 1, got ramp {v['chunk_ramp_frames']}")
        ranks, c2w, reserved = v["talker_cpus"], set(v["code2wav_cpus"]), set(v["reserved_cpus"])
        if len(ranks) != v["talker_tp_size"]:
            raise ConfigError(f"talker_cpus has {len(ranks)} rank list(s) but talker_tp_size is {v['talker_tp_size']}")
        if not self.talker_pinned and (len(ranks) != 1 or not v["talker_threads"] <= len(ranks[0])):
            raise ConfigError(f"an unpinned talker (nobind) has one CPU list and at most one thread per CPU, got "
                              f"{len(ranks)} list(s) and talker_threads {v['talker_threads']}")
        for i, r in enumerate(ranks if self.talker_pinned else ()):
            if len(r) != v["talker_threads"]:
                raise ConfigError(f"talker rank {i} CPU list {format_cpulist(r)!r} has {len(r)} CPUs but "
                                  f"talker_threads is {v['talker_threads']} (one thread per listed CPU)")
        if len(c2w) != v["code2wav_threads"]:
            raise ConfigError(f"code2wav CPU list {format_cpulist(c2w)!r} has {len(c2w)} CPUs but "
                              f"code2wav_threads is {v['code2wav_threads']}")
        talker = {c for r in ranks for c in r}
        if sum(map(len, ranks)) != len(talker):
            raise ConfigError(f"talker rank CPU lists overlap: {' | '.join(map(format_cpulist, ranks))}")
        if v["mode"] == "split" and talker & c2w:
            raise ConfigError(f"mode 'split' but talker and code2wav share CPUs {format_cpulist(talker & c2w)}")
        if v["mode"] == "shared" and not c2w <= talker:
            raise ConfigError(f"mode 'shared' but code2wav CPUs {format_cpulist(c2w - talker)} are not talker CPUs")
        if (talker | c2w) & reserved:
            raise ConfigError(f"reserved CPUs {format_cpulist((talker | c2w) & reserved)} are also in a stage list")

    # ------------------------------------------------------------------ access
    def resolved(self) -> dict[str, Resolved]:
        """Every decided field, in declaration order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), Resolved)}

    def values(self) -> dict[str, Any]:
        return {k: r.value for k, r in self.resolved().items()}

    def cpus(self, stage: str, rank: int = 0) -> tuple[int, ...]:
        _check_stage(stage)
        return tuple(self.talker_cpus.value[rank]) if stage == "talker" else tuple(self.code2wav_cpus.value)

    def threads(self, stage: str) -> int:
        _check_stage(stage)
        return self.talker_threads.value if stage == "talker" else self.code2wav_threads.value

    def bind_string(self, stage: str) -> str:
        """``VLLM_CPU_OMP_THREADS_BIND`` value: CPU lists, ``|`` between tensor-parallel ranks (``nobind`` for an
        unpinned talker)."""
        _check_stage(stage)
        if stage == "talker" and not self.talker_pinned:
            return "nobind"
        lists = self.talker_cpus.value if stage == "talker" else (self.code2wav_cpus.value,)
        return "|".join(format_cpulist(r) for r in lists)

    def chunk_sizes(self, total_frames: int) -> list[int]:
        """Chunk sizes (frames) that the talker hands to code2wav for an utterance of ``total_frames``."""
        return chunk_schedule(self.first_chunk_frames.value, self.chunk_ramp_frames.value,
                              self.steady_chunk_frames.value, total_frames)

    @property
    def kv_cache_gib(self) -> float:
        return self.kv_cache_bytes.value / GiB

    def to_env(self, stage: str) -> dict[str, str]:
        """Environment for a stage's worker process, to set before it imports torch or vLLM: the pipeline's
        workers start with exactly these values (``VllmDeploy.from_profile``); ``VLLM_CPU_KVCACHE_SPACE`` only
        when the budget is whole GiB (vLLM reads whole GiB), equal to ``engine_args``' exact bytes."""
        _check_stage(stage)
        lists = "|".join(format_cpulist(r) for r in (self.talker_cpus.value if stage == "talker" else
                                                     (self.code2wav_cpus.value,)))
        env = {"OMP_NUM_THREADS": str(self.threads(stage)), "VLLM_CPU_OMP_THREADS_BIND": self.bind_string(stage),
               "OMNILAB_STAGE": stage, "OMNILAB_STAGE_CPUS": lists,
               "OMNILAB_DTYPE": self.dtype.value}
        if self.preload.value:
            env["LD_PRELOAD"] = ":".join(self.preload.value)
        if stage == "talker" and self.quantization.value != "none":  # the worker's environment says what it loads
            env["OMNILAB_QUANTIZATION"] = self.quantization.value
        if stage == "talker" and self.kv_cache_bytes.value % GiB == 0:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_bytes.value // GiB)  # vLLM reads whole GiB
        return env

    def engine_args(self, stage: str = "talker") -> dict[str, Any]:
        """vLLM ``EngineArgs`` keywords for a stage (``kv_cache_memory_bytes`` is exact, unlike the env); the
        talker engine is built with these values (``VllmDeploy.from_profile``)."""
        _check_stage(stage)
        args: dict[str, Any] = {"dtype": self.dtype.value, "enforce_eager": True, "enable_prefix_caching": False}
        if stage == "talker":
            args.update(max_num_seqs=self.max_num_seqs.value, max_model_len=self.max_model_len.value,
                        kv_cache_memory_bytes=self.kv_cache_bytes.value, block_size=BLOCK_SIZE,
                        tensor_parallel_size=self.talker_tp_size.value)
        return args

    # ------------------------------------------------------------------ validation against a machine
    def check(self, hardware: "HardwareInfo") -> list[str]:
        """Raise ``ConfigError`` for CPUs outside the affinity mask or a KV budget above available memory;
        return warnings for legal but slow layouts (a list crossing NUMA nodes, SMT siblings in one list)."""
        usable = set(hardware.usable_cpus)
        lists = {f"talker rank {i}": r for i, r in enumerate(self.talker_cpus.value)}
        lists.update({"code2wav": self.code2wav_cpus.value, "reserved": self.reserved_cpus.value})
        for what, cpus in lists.items():
            outside = sorted(set(cpus) - usable)
            if outside:
                raise ConfigError(
                    f"{what} CPU list {format_cpulist(cpus)!r} names CPUs {format_cpulist(outside)} outside this "
                    f"process's usable CPUs {format_cpulist(usable) or '(none)'} (affinity mask and online CPUs)")
        kv, src = self.kv_cache_bytes.value, self.kv_cache_bytes.source
        cap = hardware.memory_available_bytes
        if kv > cap:
            raise ConfigError(f"kv_cache_bytes {kv / GiB:.2f} GiB ({src}) is above the available memory "
                              f"{cap / GiB:.2f} GiB")
        for i, r in enumerate(self.talker_cpus.value):  # vLLM's worker allocates its KV cache on its NUMA node
            node = hardware.node_of(r[0])
            total, avail = hardware.node_memory(node)
            if avail is not None and kv > avail:
                raise ConfigError(f"kv_cache_bytes {kv / GiB:.2f} GiB ({src}) is above the available memory of NUMA "
                                  f"node {node} ({avail / GiB:.2f} GiB of {(total or 0) / GiB:.2f} GiB), where talker rank "
                                  f"{i} runs and vLLM allocates its KV cache (vLLM refuses to start so)")
        warnings = []
        sibling = {c: core.cpus for core in hardware.cores for c in core.cpus}
        checked = list(lists.items())[:-1]
        if not self.talker_pinned:
            checked = checked[1:]
            warnings.append(f"talker threads are not pinned (VLLM_CPU_OMP_THREADS_BIND=nobind): the OS may move them "
                            f"across CPUs {format_cpulist(self.talker_cpus.value[0])}, SMT siblings and NUMA nodes "
                            f"included")
        for what, cpus in checked:
            nodes = sorted({hardware.node_of(c) for c in cpus})
            if len(nodes) > 1:
                warnings.append(f"{what} CPU list {format_cpulist(cpus)} crosses NUMA nodes {nodes}")
            pairs = [c for c in cpus if any(s != c and s in cpus for s in sibling.get(c, ()))]
            if pairs:
                warnings.append(f"{what} CPU list {format_cpulist(cpus)} holds SMT siblings {format_cpulist(pairs)}")
        ranks = self.talker_cpus.value
        if len(ranks) > 1 and len({hardware.node_of(r[0]) for r in ranks}) < len(ranks):
            warnings.append(shared_node_warning(len(ranks), sorted({hardware.node_of(r[0]) for r in ranks})))
        distinct = len({c for r in self.talker_cpus.value for c in r} | set(self.code2wav_cpus.value))
        if distinct > hardware.cpu_limit:
            warnings.append(f"stages use {distinct} CPUs but the cgroup quota allows {hardware.cpu_limit:g}")
        return warnings

    def replace(self, **changes: Any) -> "DeployProfile":
        """Copy with some fields replaced; plain values become ``Resolved(value, 'set by argument')``."""
        fixed = {k: v if isinstance(v, Resolved) or k not in self.resolved() else Resolved(v, "set by argument",
                 "argument") for k, v in changes.items()}
        return dataclasses.replace(self, **fixed)

    # ------------------------------------------------------------------ serialisation and display
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "hardware": self.hardware}
        for k, r in self.resolved().items():
            val = [list(x) for x in r.value] if k == "talker_cpus" else list(r.value) if isinstance(r.value, tuple) else r.value
            out[k] = {"value": val, "reason": r.reason, "source": r.source}
        out["estimate"] = dataclasses.asdict(self.estimate) if self.estimate else None
        out["memory_cap_bytes"] = self.memory_cap_bytes
        out["warnings"] = list(self.warnings)
        out["talker_pinned"] = self.talker_pinned
        return out

    def to_yaml(self, path: Any = None) -> str:
        return profile_to_yaml(self, path)

    @classmethod
    def from_yaml(cls, source: Any) -> "DeployProfile":
        fields, extra = profile_fields_from_yaml(source)
        return cls(**extra, **{k: Resolved(*v) for k, v in fields.items()})

    def rows(self) -> list[tuple[str, str, str, str]]:
        return [(k, _show(k, r.value), r.source, r.reason) for k, r in self.resolved().items()]

    def __repr__(self) -> str:
        v, e = self.values(), self.estimate
        chunks = "/".join(map(str, (v["first_chunk_frames"], *v["chunk_ramp_frames"], v["steady_chunk_frames"])))
        return (f"DeployProfile({self.name!r}, {v['mode']}: talker {v['talker_threads']} thr "
                f"[{_show('talker_cpus', v['talker_cpus'])}], code2wav {v['code2wav_threads']} thr "
                f"[{format_cpulist(v['code2wav_cpus'])}], {v['dtype']}"
                + (f" {v['quantization']}" if v["quantization"] != "none" else "") + f", KV {self.kv_cache_gib:.2f} GiB, "
                f"chunks {chunks}" + (f", est. RTF {e.rtf:.2f}" if e else "") + ")")

    def __str__(self) -> str:
        rows = self.rows()
        w = [max(len(r[i]) for r in rows + [("field", "value", "source", "")]) for i in range(3)]
        lines = [f"DeployProfile {self.name!r}" + (f" on {self.hardware}" if self.hardware else "")]
        lines += [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d}" for a, b, c, d in [("field", "value", "source",
                                                                                     "reason"), *rows]]
        if self.estimate:
            lines.append("estimate: " + self.estimate.describe())
        lines += [f"warning: {x}" for x in self.warnings]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = f"<b>DeployProfile {html.escape(repr(self.name))}</b>" + (
            f" on {html.escape(self.hardware)}" if self.hardware else "")
        tail = f"<p>estimate: {html.escape(self.estimate.describe())}</p>" if self.estimate else ""
        tail += "".join(f"<p>warning: {html.escape(w)}</p>" for w in self.warnings)
        return head + html_table(["field", "value", "source", "reason"], self.rows()) + tail


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; accepted: {', '.join(STAGES)}")
