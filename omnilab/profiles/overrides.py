"""Override sources for ``plan()``: environment variables > arguments > preset/file values > auto.

Contract: ``Overrides.get(field)`` returns ``(value, source)`` from the highest-precedence layer that
sets ``field``, parsed and validated, or ``None``. Bad values raise ``ConfigError`` naming the variable
(or argument) and the offending text. The environment wins over arguments so an operator can change a
notebook's deployment without editing it (as ``NANOCHAT_DTYPE`` does in nanochat).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from omnilab.errors import ConfigError
from omnilab.hardware import GiB, parse_cpulist

DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "f32": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16"}


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


def _rank_cpus(v: Any, where: str) -> tuple[tuple[int, ...], ...]:
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


def _dtype(v: Any, where: str) -> str:
    s = str(v).strip().lower().replace("torch.", "")
    if s in ("float16", "fp16", "half"):
        raise ConfigError(f"{where}={v!r}: float16 is not supported on CPU (unstable in torch CPU kernels and it "
                          f"gives NaN logits in the code predictor); use bfloat16 or float32")
    if s not in DTYPE_ALIASES:
        raise ConfigError(f"{where}={v!r}: accepted dtypes are float32 (fp32) and bfloat16 (bf16)")
    return DTYPE_ALIASES[s]


def _gib(v: Any, where: str) -> int:
    try:
        g = float(v)
    except (TypeError, ValueError):
        g = -1.0
    if not g > 0:
        raise ConfigError(f"{where}={v!r}: expected a positive number of GiB")
    return int(round(g * GiB))


def _bytes(v: Any, where: str) -> int:
    return _pos_int(v, where)


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


# field -> (environment variable, parser, help)
FIELDS: dict[str, tuple[str, Callable[[Any, str], Any], str]] = {
    "mode": ("OMNILAB_STAGE_MODE", _mode, "split | shared"),
    "talker_tp_size": ("OMNILAB_TALKER_TP", _pos_int, "tensor-parallel ranks for the talker, one per NUMA node"),
    "talker_threads": ("OMNILAB_TALKER_THREADS", _pos_int, "OpenMP threads per talker rank"),
    "talker_cpus": ("OMNILAB_TALKER_CPUS", _rank_cpus, "talker CPU list(s), '|' between ranks: '0-13|28-41'"),
    "code2wav_threads": ("OMNILAB_CODE2WAV_THREADS", _pos_int, "code2wav OpenMP threads"),
    "code2wav_cpus": ("OMNILAB_CODE2WAV_CPUS", _cpus, "code2wav CPU list: '14-15'"),
    "reserved_cpus": ("OMNILAB_RESERVED_CPUS", _reserved, "CPUs kept free for the front-end: '0' or 'none'"),
    "dtype": ("OMNILAB_DTYPE", _dtype, "float32 | bfloat16"),
    "max_num_seqs": ("OMNILAB_MAX_NUM_SEQS", _pos_int, "concurrent talker sequences"),
    "max_model_len": ("OMNILAB_MAX_MODEL_LEN", _pos_int, "talker context length (tokens)"),
    "kv_cache_bytes": ("OMNILAB_KV_CACHE_GIB", _gib, "talker KV cache budget in GiB (float)"),
    "first_chunk_frames": ("OMNILAB_FIRST_CHUNK_FRAMES", _pos_int, "frames in the first code2wav chunk"),
    "chunk_ramp_frames": ("OMNILAB_CHUNK_RAMP", _ramp, "chunk sizes after the first: '4,8,16' or 'none'"),
    "steady_chunk_frames": ("OMNILAB_CHUNK_FRAMES", _pos_int, "steady-state chunk size (frames)"),
    "left_context_frames": ("OMNILAB_LEFT_CONTEXT_FRAMES", _nonneg_int, "code2wav left context (frames)"),
    "preload": ("OMNILAB_PRELOAD", _preload, "LD_PRELOAD for workers, ':'-separated, or 'none'"),
}


class Overrides:
    """Layered override lookup. ``args`` and ``defaults`` use field names (``kv_cache_gib`` is accepted
    for ``kv_cache_bytes``); ``defaults_source`` labels the preset or file they came from."""

    def __init__(self, env: Mapping[str, str], args: Mapping[str, Any] | None = None,
                 defaults: Mapping[str, Any] | None = None, defaults_source: str = "preset"):
        self.env = env
        self.args = self._normalise(args or {}, "argument")
        self.defaults = self._normalise(defaults or {}, defaults_source)
        self.defaults_source = defaults_source

    @staticmethod
    def _normalise(d: Mapping[str, Any], label: str) -> dict[str, Any]:
        out = {k: v for k, v in d.items() if v is not None}
        if "kv_cache_gib" in out:
            out["kv_cache_bytes"] = _gib(out.pop("kv_cache_gib"), f"{label} kv_cache_gib")
        unknown = sorted(set(out) - set(FIELDS))
        if unknown:
            raise ConfigError(f"unknown profile field(s) {', '.join(map(repr, unknown))} in {label}; "
                              f"accepted: {', '.join(FIELDS)}, kv_cache_gib")
        return out

    def get(self, name: str) -> tuple[Any, str] | None:
        var, parse, _ = FIELDS[name]
        raw = self.env.get(var)
        if raw is not None and str(raw).strip() != "":
            return parse(raw, var), f"env {var}"
        for layer, label in ((self.args, "argument"), (self.defaults, self.defaults_source)):
            if name in layer:
                v = layer[name]
                return (_bytes if name == "kv_cache_bytes" else parse)(v, f"{label} {name}"), label
        return None


def env_help() -> str:
    """One line per environment variable, for docs and ``omnilab plan --help``."""
    return "\n".join(f"  {var:<28} {field:<20} {text}" for field, (var, _, text) in FIELDS.items())
