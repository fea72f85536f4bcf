"""Override sources for ``plan()``, highest first: ``OMNILAB_*`` environment > vLLM's CPU environment
(``VLLM_CPU_*``) > arguments > preset/file values > auto.

Contract: ``Overrides.get(field)`` returns ``(value, source)`` from the highest-precedence layer that
sets ``field``, parsed and validated, or ``None``. Bad values raise ``ConfigError`` naming the variable
(or argument) and the offending text. The environment wins over arguments so an operator can change a
notebook's deployment without editing it (as ``NANOCHAT_DTYPE`` does in nanochat).

vLLM's own CPU variables are a layer of their own (source ``"env (vLLM) NAME"``), read as vLLM reads them
(``vllm/envs.py``, ``vllm/platforms/cpu.py``, ``vllm/utils/ompmultiprocessing.py``):

- ``VLLM_CPU_KVCACHE_SPACE=N`` -> ``kv_cache_bytes`` = N GiB (vLLM takes ``int()``: whole GiB, >= 1).
- ``VLLM_CPU_OMP_THREADS_BIND`` -> ``talker_cpus``: CPU lists (``'0-13|28-41'``, ``|`` between tensor-parallel
  ranks); ``auto`` (vLLM's default: automatic binding; here the planner places the talker with vLLM's rules:
  one CPU per physical core, rank i on its own NUMA node) fixes nothing but shows its source; ``nobind`` (and
  ``all``, its name before vLLM 0.10, passed to the engine as ``nobind``) leaves the talker's OpenMP threads
  unpinned (``DeployProfile.talker_pinned`` False).
- ``VLLM_CPU_NUM_OF_RESERVED_CPU=N`` -> ``reserved_cpus``: a count, resolved by the planner the way vLLM's auto
  binding reserves CPUs (the last N physical cores of the talker's NUMA node(s), last rank first); vLLM
  ignores it with explicit CPU lists or ``nobind``, and so does the plan (its reason says so).

An ``OMNILAB_*`` variable and the vLLM variable for the same field may both be set only when they agree
(``VLLM_CPU_OMP_THREADS_BIND=auto`` agrees with anything); otherwise ``get`` raises ``ConfigError`` naming
both, since one of them would be silently ignored. ``gpu_memory_utilization`` (an argument or a preset/file
value; vLLM has no variable for it) sizes the KV budget as vLLM's CPU worker does (a fraction of the talker's
NUMA node memory); a ``kv_cache_bytes`` in the same or a higher layer wins, as ``kv_cache_memory_bytes``
does in vLLM. ``VLLM_OMNI_CPU_INDUCTOR`` is an engine option, not a profile field: see
``omnilab.stages.vllm.config.compile_predictor_flag``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from omnilab import settings
from omnilab.config import parse_quantization, quantization_spelling
from omnilab.errors import ConfigError
from omnilab.hardware import GiB, HardwareInfo, format_cpulist, parse_cpulist
from omnilab.profiles.resolved import Resolved
from omnilab.settings import PROFILE_FIELDS, REMOVED_VARIABLES
from omnilab.settings import dtype_name as _dtype


def _pos_int(v: Any, where: str) -> int:
    try:
        n = int(str(v).strip()) if not isinstance(v, bool) else None
    except ValueError:
        n = None
    if n is None or n < 1 or (isinstance(v, float) and v != n):
        raise ConfigError(f"{where}={v!r}: expected a positive integer")
    return n


def _nonneg_int(v: Any, where: str) -> int:
    if str(v).strip() == "0":
        return 0
    return _pos_int(v, where)


def _cpus(v: Any, where: str) -> tuple[int, ...]:
    try:
        if isinstance(v, str):
            out = parse_cpulist(v)
        else:
            out = tuple(sorted({int(x) for x in v}))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}={v!r}: expected a CPU list such as '0-3,8' ({e})") from None
    if not out:
        raise ConfigError(f"{where}={v!r}: the CPU list is empty")
    return out


AUTO, NOBIND = "auto", "nobind"
BIND_WORDS = {"auto": AUTO, "nobind": NOBIND, "all": NOBIND}  # vLLM's VLLM_CPU_OMP_THREADS_BIND keywords


def _rank_cpus(v: Any, where: str) -> tuple[tuple[int, ...], ...] | str:
    """CPU list(s) with ``|`` between ranks, or one of vLLM's keywords: ``auto`` -> ``AUTO``, ``nobind`` / ``all``
    -> ``NOBIND``."""
    if isinstance(v, str) and v.strip().lower() in BIND_WORDS:
        return BIND_WORDS[v.strip().lower()]
    if isinstance(v, str) and not v.strip():
        raise ConfigError(f"{where}={v!r}: expected CPU list(s) such as '0-3' or '0-13|28-41', or auto / nobind / all")
    parts: Iterable[Any] = v.split("|") if isinstance(v, str) else v
    if not isinstance(v, str) and all(isinstance(x, int) for x in v):
        parts = [v]
    return tuple(_cpus(p, where) for p in parts)


def _reserved(v: Any, where: str) -> tuple[int, ...]:
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none")) or (not isinstance(v, str) and not v):
        return ()
    return _cpus(v, where)


def _mode(v: Any, where: str) -> str:
    s = str(v).strip().lower()
    if s not in ("split", "shared"):
        raise ConfigError(f"{where}={v!r}: accepted values are 'split' (each stage on its own cores) and "
                          f"'shared' (code2wav runs one thread on a talker core)")
    return s


def _gib(v: Any, where: str) -> int:
    try:
        g = float(v) if not isinstance(v, bool) else -1.0
    except (TypeError, ValueError):
        g = -1.0
    if not 0 < g < 1 << 20:  # NaN, inf and negatives fail here (a PiB of KV cache is no budget either)
        raise ConfigError(f"{where}={v!r}: expected a positive, finite number of GiB (below 1048576), e.g. '4' or "
                          f"'0.5'")
    return int(round(g * GiB))


def _bytes(v: Any, where: str) -> int:
    return _pos_int(v, where)


def whole_gib(v: Any, where: str) -> int:
    """``VLLM_CPU_KVCACHE_SPACE``: vLLM reads ``int(value)`` GiB (``'1.5'`` would crash it) -> bytes."""
    try:
        n = int(str(v).strip())
    except ValueError:
        raise ConfigError(f"{where}={v!r}: vLLM reads a whole number of GiB (int()), e.g. '4'") from None
    if n < 1:
        raise ConfigError(f"{where}={v!r}: must be at least 1 GiB (vLLM would size the KV cache at {n} GiB)")
    return n * GiB


def reserve_count(v: Any, where: str) -> int:
    """``VLLM_CPU_NUM_OF_RESERVED_CPU``: a non-negative integer (vLLM reads ``int()``)."""
    try:
        n = int(str(v).strip())
    except ValueError:
        n = -1
    if n < 0:
        raise ConfigError(f"{where}={v!r}: expected a number of CPUs >= 0 (vLLM reads int())")
    return n


def _fraction(v: Any, where: str) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = -1.0
    if not 0 < f <= 1 or isinstance(v, bool):
        raise ConfigError(f"{where}={v!r}: expected a fraction in (0, 1] of the NUMA node's memory "
                          f"(vLLM's CPU meaning of gpu_memory_utilization)")
    return f


def _ramp(v: Any, where: str) -> tuple[int, ...]:
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none")):
        return ()
    items = v.replace(" ", "").split(",") if isinstance(v, str) else list(v)
    return tuple(_pos_int(x, where) for x in items)


def _preload(v: Any, where: str) -> tuple[str, ...]:
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none")):
        return ()
    items = v.split(":") if isinstance(v, str) else list(v)
    libs = tuple(str(x).strip() for x in items if str(x).strip())
    if any("libgomp" in x for x in libs) and any("libiomp" in x or "libomp" in x for x in libs):
        raise ConfigError(f"{where}={v!r}: libgomp and libiomp5 cannot both be preloaded (vLLM asserts on it)")
    return libs


def _quantization(v: Any, where: str) -> str:
    return quantization_spelling(*parse_quantization(v, where))


parse_bind = _rank_cpus  # VLLM_CPU_OMP_THREADS_BIND syntax, for the engine


# field -> parser; each field's variable and help are declared in omnilab/settings.py (PROFILE_FIELDS)
_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "mode": _mode,
    "talker_tp_size": _pos_int,
    "talker_threads": _pos_int,
    "talker_cpus": _rank_cpus,
    "code2wav_threads": _pos_int,
    "code2wav_cpus": _cpus,
    "reserved_cpus": _reserved,
    "dtype": _dtype,
    "quantization": _quantization,
    "max_num_seqs": _pos_int,
    "max_model_len": _pos_int,
    "kv_cache_bytes": _gib,
    "first_chunk_frames": _pos_int,
    "chunk_ramp_frames": _ramp,
    "steady_chunk_frames": _pos_int,
    "preload": _preload,
}
# field -> (environment variable, parser, help)
FIELDS: dict[str, tuple[str, Callable[[Any, str], Any], str]] = {
    field: (var, _PARSERS[field], text) for field, (var, text) in PROFILE_FIELDS.items()}


# field -> (vLLM environment variable, parser, help): the "env (vLLM)" layer, below OMNILAB_* variables
VLLM_FIELDS: dict[str, tuple[str, Callable[[Any, str], Any], str]] = {
    "kv_cache_bytes": ("VLLM_CPU_KVCACHE_SPACE", whole_gib, "talker KV cache in whole GiB"),
    "talker_cpus": ("VLLM_CPU_OMP_THREADS_BIND", _rank_cpus,
                    "talker CPU list(s), '|' between ranks; auto | nobind | all"),
    "reserved_cpus": ("VLLM_CPU_NUM_OF_RESERVED_CPU", reserve_count, "reserve N CPUs the way vLLM's auto binding does"),
}
# inputs that are not profile fields: argument / preset / file only
EXTRA_ARGS: dict[str, Callable[[Any, str], Any]] = {"gpu_memory_utilization": _fraction}
LAYERS = ("env", "env (vLLM)", "argument", "defaults")  # rank 0 .. 3 of Overrides.get_ranked


def _agree(name: str, ours: Any, theirs: Any) -> bool:
    if name == "talker_cpus" and theirs == AUTO:
        return True
    if name == "reserved_cpus" and isinstance(theirs, int):
        return theirs == 0 and ours == ()
    return ours == theirs


class Overrides:
    """Layered override lookup. ``args`` and ``defaults`` use field names (``kv_cache_gib`` is accepted
    for ``kv_cache_bytes``, ``gpu_memory_utilization`` too); ``defaults_source`` labels the preset or file
    they came from."""

    def __init__(self, env: Mapping[str, str], args: Mapping[str, Any] | None = None,
                 defaults: Mapping[str, Any] | None = None, defaults_source: str = "preset"):
        for var, why in REMOVED_VARIABLES.items():
            if str(env.get(var) or "").strip():
                raise ConfigError(f"{var}={env[var]!r} is not used any more: {why}; unset it")
        self.env = env
        self.args = self._normalise(args or {}, "argument")
        self.defaults = self._normalise(defaults or {}, defaults_source)
        self.defaults_source = defaults_source

    @staticmethod
    def _normalise(d: Mapping[str, Any], label: str) -> dict[str, Any]:
        out = {k: v for k, v in d.items() if v is not None}
        if "kv_cache_gib" in out:
            out["kv_cache_bytes"] = _gib(out.pop("kv_cache_gib"), f"{label} kv_cache_gib")
        unknown = sorted(set(out) - set(FIELDS) - set(EXTRA_ARGS))
        if unknown:
            raise ConfigError(f"unknown profile field(s) {', '.join(map(repr, unknown))} in {label}; "
                              f"accepted: {', '.join(FIELDS)}, kv_cache_gib, {', '.join(EXTRA_ARGS)}")
        return out

    def _env_value(self, var: str, parse: Callable[[Any, str], Any], label: str) -> tuple[Any, str] | None:
        raw = settings.raw(var, self.env) if var.startswith("OMNILAB_") else self.env.get(var)
        if raw is None or str(raw).strip() == "":
            return None
        return parse(raw, var), f"{label} {var}"

    def get_ranked(self, name: str) -> tuple[Any, str, int] | None:
        """``(value, source, rank)``; ``rank`` indexes ``LAYERS`` (0 = ``OMNILAB_*`` environment)."""
        if name in EXTRA_ARGS:
            found = None
        else:
            var, parse, _ = FIELDS[name]
            ours = self._env_value(var, parse, "env")
            theirs = self._env_value(*VLLM_FIELDS[name][:2], "env (vLLM)") if name in VLLM_FIELDS else None
            if ours and theirs and not _agree(name, ours[0], theirs[0]):
                raise ConfigError(f"{var}={settings.raw(var, self.env)!r} and {VLLM_FIELDS[name][0]}="
                                  f"{self.env[VLLM_FIELDS[name][0]]!r} both set {name} and disagree; unset one "
                                  f"(omnilab would apply one and vLLM might read the other)")
            found = (*ours, 0) if ours else (*theirs, 1) if theirs else None
        if found:
            return found
        for rank, layer, label in ((2, self.args, "argument"), (3, self.defaults, self.defaults_source)):
            if name in layer:
                parse = EXTRA_ARGS.get(name) or (_bytes if name == "kv_cache_bytes" else FIELDS[name][1])
                return parse(layer[name], f"{label} {name}"), label, rank
        return None

    def get(self, name: str) -> tuple[Any, str] | None:
        got = self.get_ranked(name)
        return got[:2] if got else None

    def env_set(self) -> bool:
        """Whether any OMNILAB_* or vLLM CPU variable of this layer is set (non-empty)."""
        names = [v for v, _, _ in FIELDS.values()] + [v for v, _, _ in VLLM_FIELDS.values()]
        return any(str((settings.raw(n, self.env) if n.startswith("OMNILAB_") else self.env.get(n)) or "").strip()
                   for n in names)


def vllm_reserved_cores(hw: HardwareInfo, n: int, src: str, bind: tuple[Any, str] | None, tp: int) -> Resolved:
    """``VLLM_CPU_NUM_OF_RESERVED_CPU=n`` as vLLM's auto binding applies it (``vllm/utils/ompmultiprocessing.py``):
    rank i's list is NUMA node i's CPUs, one per physical core; ``n // tp`` CPUs come off the end of every
    rank's list and one more off the last ``n % tp`` ranks; nothing when ``n`` is not below the listed CPUs.
    Here the whole physical core is kept free (its SMT siblings too)."""
    if bind and bind[0] != AUTO:
        given = "are unpinned ('nobind')" if bind[0] == NOBIND else "are given as CPU lists"
        return Resolved((), f"{n}: no effect: vLLM reserves CPUs only under VLLM_CPU_OMP_THREADS_BIND=auto, and the "
                        f"talker's CPUs {given} ({bind[1]})", src)
    if n == 0:
        return Resolved((), f"set by {src}; 0: nothing reserved (vLLM's minimum is 1 CPU per rank for its engine core)",
                        src)
    nodes = sorted({c.node for c in hw.usable_cores})[:tp]
    per_node = {nid: [c for c in hw.usable_cores if c.node == nid] for nid in nodes}
    total = sum(map(len, per_node.values()))
    if total <= n:
        return Resolved((), f"{n} ({src}): none: vLLM reserves nothing (and logs a warning) when the count is not "
                        f"below the {total} CPUs of its auto lists", src)
    counts = [n // tp] * len(nodes)
    for i in range(len(nodes) - 1, len(nodes) - 1 - n % tp, -1):
        counts[i] += 1
    taken = [c for nid, k in zip(nodes, counts) if k for c in per_node[nid][-k:]]
    cpus = tuple(sorted(x for c in taken for x in c.cpus))
    where = ", ".join(f"node {nid}" for nid, k in zip(nodes, counts) if k)
    return Resolved(cpus, f"{n} ({src}): the last {n} physical core(s) of the talker's NUMA node(s) ({where}): CPUs "
                    f"{format_cpulist(cpus)}, as vLLM's auto binding reserves them (last rank first) for its "
                    f"engine-core process and the front-end", src)


def env_help() -> str:
    """One line per environment variable, for docs and ``omnilab plan --help``."""
    lines = [f"  {var:<28} {field:<20} {text}" for field, (var, _, text) in FIELDS.items()]
    lines += [f"  {var:<28} {field:<20} {text} (vLLM's; below OMNILAB_*)"
              for field, (var, _, text) in VLLM_FIELDS.items()]
    return "\n".join(lines)
