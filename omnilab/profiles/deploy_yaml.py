"""Deploy profiles as YAML in the vllm-omni deploy format (the document format only: no profile class here).

Contract: ``profile_to_yaml`` writes the vllm-omni layout (``connectors`` with the codec chunking keys,
``stages`` with per-stage engine settings, a ``platforms: cpu:`` overlay with each stage's environment:
``VLLM_CPU_OMP_THREADS_BIND``, ``OMP_NUM_THREADS``, ``VLLM_CPU_KVCACHE_SPACE``, ``LD_PRELOAD``, and the talker's
``OMNILAB_QUANTIZATION``: omnilab's weight-only decode quantization, which is no vLLM ``quantization`` method,
so it travels as the talker process's environment) plus an
``omnilab:`` block with every field's reason and source, so ``DeployProfile.from_yaml(p.to_yaml()) == p``
(``profile_fields_from_yaml`` reads it back). A file or preset may also be partial: ``resolve_profile``
(:mod:`omnilab.profiles.resolve`) then plans the missing fields (values from the
file rank below arguments, ``OMNILAB_*`` and vLLM's CPU environment variables). The env blocks take vLLM's
syntax: ``VLLM_CPU_OMP_THREADS_BIND`` CPU lists (``|`` between ranks), ``auto`` (the planner places the
stage), ``nobind`` or ``all`` (talker: unpinned threads; code2wav, whose omnilab worker always pins its
threads: placed by the planner); ``VLLM_CPU_KVCACHE_SPACE`` in whole GiB; a talker stage's
``gpu_memory_utilization`` sizes the KV budget as vLLM's CPU worker does unless ``kv_cache_memory_bytes`` is
given. Errors name the file and key.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from omnilab import settings
from omnilab.errors import ConfigError
from omnilab.hardware import format_cpulist
from omnilab.profiles.cost import StreamEstimate
from omnilab.profiles.overrides import BIND_WORDS, EXTRA_ARGS, FIELDS, NOBIND, Overrides, whole_gib

_CONNECTOR = "connector_of_shared_memory"
_CARRIED = ("OMNILAB_QUANTIZATION",)  # omnilab variables a stage's env block carries (the others are derived)


def profile_to_yaml(profile: Any, path: str | os.PathLike | None = None) -> str:
    v = profile.values()
    extra: dict[str, Any] = {"codec_streaming": True, "codec_chunk_frames": v["steady_chunk_frames"],
                             "initial_codec_chunk_frames": v["first_chunk_frames"]}
    if v["chunk_ramp_frames"]:
        extra["codec_chunk_ramp"] = [v["first_chunk_frames"], *v["chunk_ramp_frames"]]
    common = {"dtype": v["dtype"], "enforce_eager": True, "enable_prefix_caching": False}
    stages = [
        {"stage_id": 0, "stage_name": "talker", **common, "max_num_seqs": v["max_num_seqs"],
         "max_model_len": v["max_model_len"], "kv_cache_memory_bytes": v["kv_cache_bytes"],
         "tensor_parallel_size": v["talker_tp_size"], "output_connectors": {"to_stage_1": _CONNECTOR}},
        {"stage_id": 1, "stage_name": "code2wav", **common, "input_connectors": {"from_stage_0": _CONNECTOR}},
    ]
    cpu_stages = []
    for i, stage in enumerate(("talker", "code2wav")):
        env = {k: val for k, val in profile.to_env(stage).items() if not k.startswith("OMNILAB_") or k in _CARRIED}
        env.setdefault("LD_PRELOAD", "")
        if stage == "talker":  # omnilab's weight-only quantization is no vLLM quantization method: an env entry
            env.setdefault("OMNILAB_QUANTIZATION", v["quantization"])
        cpu_stages.append({"stage_id": i, "env": env})
    doc = {
        "name": profile.name, "async_chunk": True,
        "connectors": {_CONNECTOR: {"name": "SharedMemoryConnector", "extra": extra}},
        "stages": stages,
        "platforms": {"cpu": {"stage_mode": v["mode"], "reserved_cpus": format_cpulist(v["reserved_cpus"]),
                              "stages": cpu_stages}},
        "omnilab": {"format": 1, "hardware": profile.hardware, "memory_cap_bytes": profile.memory_cap_bytes,
                    "estimate": dataclasses.asdict(profile.estimate) if profile.estimate else None,
                    "warnings": list(profile.warnings),
                    **({} if profile.talker_pinned else {"unpinned_talker_cpus": format_cpulist(v["talker_cpus"][0])}),
                    "reasons": {k: {"source": r.source, "reason": r.reason} for k, r in profile.resolved().items()}},
    }
    head = (f"# omnilab deploy profile {profile.name!r}: vllm-omni deploy format (stages + platforms.cpu overlay).\n"
            + (f"# planned on: {profile.hardware}\n" if profile.hardware else "")
            + (f"# estimate: {profile.estimate.describe()}\n" if profile.estimate else ""))
    text = head + yaml.safe_dump(doc, sort_keys=False, width=120, allow_unicode=True)
    if path is not None:
        Path(path).write_text(text)
    return text


def load_yaml_doc(source: Any) -> tuple[dict, str]:
    """(document, label) from a path, YAML text or a mapping; malformed YAML -> ``ConfigError``."""
    if isinstance(source, Mapping):
        return dict(source), "<mapping>"
    text, label = None, "<yaml text>"
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source
                                            and source.rstrip().endswith((".yaml", ".yml"))):
        label = str(source)
        try:
            text = Path(source).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read deploy profile {label}: {e.strerror or e}") from None
    elif isinstance(source, str):
        text = source
    else:
        raise ConfigError(f"deploy profile source must be a path, YAML text or a mapping, got {type(source).__name__}")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{label} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{label}: expected a YAML mapping at the top level, got {type(doc).__name__}")
    return doc, label


def _by_id(items: Any, where: str) -> dict[int, dict]:
    if items is None:
        return {}
    if not isinstance(items, list) or not all(isinstance(s, dict) and "stage_id" in s for s in items):
        raise ConfigError(f"{where} must be a list of mappings with a stage_id")
    return {int(s["stage_id"]): s for s in items}


def values_from_doc(doc: Mapping[str, Any], label: str) -> dict[str, Any]:
    """Field values a deploy document sets (possibly a subset), parsed and validated."""
    raw: dict[str, tuple[Any, str]] = {}
    conn = (doc.get("connectors") or {}).get(_CONNECTOR, {}) or {}
    extra = conn.get("extra") or {}
    stages = _by_id(doc.get("stages"), "stages")
    cpu = (doc.get("platforms") or {}).get("cpu") or {}
    cpu_stages = _by_id(cpu.get("stages"), "platforms.cpu.stages")
    if "codec_chunk_ramp" in extra:
        ramp = extra["codec_chunk_ramp"]
        if not isinstance(ramp, list) or not ramp:
            raise ConfigError(f"{label}: connectors.{_CONNECTOR}.extra.codec_chunk_ramp must be a non-empty list, "
                              f"got {ramp!r}")
        raw["first_chunk_frames"] = (ramp[0], "codec_chunk_ramp[0]")
        raw["chunk_ramp_frames"] = (ramp[1:], "codec_chunk_ramp")
    elif "initial_codec_chunk_frames" in extra:
        raw["first_chunk_frames"] = (extra["initial_codec_chunk_frames"], "initial_codec_chunk_frames")
        raw["chunk_ramp_frames"] = ((), "codec_chunk_ramp")
    if "codec_chunk_frames" in extra:
        raw["steady_chunk_frames"] = (extra["codec_chunk_frames"], "codec_chunk_frames")
    s0, s1 = stages.get(0, {}), stages.get(1, {})
    for key, fld in (("dtype", "dtype"), ("max_num_seqs", "max_num_seqs"), ("max_model_len", "max_model_len"),
                     ("tensor_parallel_size", "talker_tp_size"), ("gpu_memory_utilization", "gpu_memory_utilization")):
        if key in s0:
            raw[fld] = (s0[key], f"stages[0].{key}")
    if "dtype" in s1 and "dtype" in s0 and str(s1["dtype"]) != str(s0["dtype"]):
        raise ConfigError(f"{label}: stage dtypes differ ({s0['dtype']!r} vs {s1['dtype']!r}); one dtype is used")
    e0, e1 = (cpu_stages.get(i, {}).get("env") or {} for i in (0, 1))
    if "kv_cache_memory_bytes" in s0:
        raw["kv_cache_bytes"] = (s0["kv_cache_memory_bytes"], "stages[0].kv_cache_memory_bytes")
    elif "VLLM_CPU_KVCACHE_SPACE" in e0:
        raw["kv_cache_bytes"] = (whole_gib(e0["VLLM_CPU_KVCACHE_SPACE"], f"{label}: stage 0 VLLM_CPU_KVCACHE_SPACE"),
                                 "VLLM_CPU_KVCACHE_SPACE (GiB)")
    for env, prefix in ((e0, "talker"), (e1, "code2wav")):
        bind = str(env.get("VLLM_CPU_OMP_THREADS_BIND", "")).strip()
        if bind and not (prefix == "code2wav" and bind.lower() in BIND_WORDS):  # code2wav keywords: planner places
            raw[f"{prefix}_cpus"] = (bind, "VLLM_CPU_OMP_THREADS_BIND")
        if "OMP_NUM_THREADS" in env:
            raw[f"{prefix}_threads"] = (env["OMP_NUM_THREADS"], "OMP_NUM_THREADS")
    if "OMNILAB_QUANTIZATION" in e0:
        raw["quantization"] = (settings.raw("OMNILAB_QUANTIZATION", e0) or "none", "OMNILAB_QUANTIZATION")
    if "LD_PRELOAD" in e0:
        raw["preload"] = (e0["LD_PRELOAD"] or "none", "LD_PRELOAD")
    if "stage_mode" in cpu:
        raw["mode"] = (cpu["stage_mode"], "platforms.cpu.stage_mode")
    if "reserved_cpus" in cpu:
        raw["reserved_cpus"] = (cpu["reserved_cpus"] if cpu["reserved_cpus"] not in ("", None, []) else "none",
                                "platforms.cpu.reserved_cpus")
    out = {}
    for fld, (value, key) in raw.items():
        where = f"{label}: {key}"
        if fld == "kv_cache_bytes":
            try:
                out[fld] = int(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{where}={value!r}: expected a number of bytes") from None
            if out[fld] < 1:
                raise ConfigError(f"{where}={value!r}: must be positive")
        else:
            out[fld] = (EXTRA_ARGS.get(fld) or FIELDS[fld][1])(value, where)
    return out


def _open_bind(doc: Mapping[str, Any], values: Mapping[str, Any]) -> bool:
    """The talker bind is a keyword the file does not resolve: ``auto`` (the planner places the talker), or
    ``nobind`` without the CPU list it was planned on (``omnilab.unpinned_talker_cpus``)."""
    cpus = values.get("talker_cpus")
    return isinstance(cpus, str) and not (cpus == NOBIND and (doc.get("omnilab") or {}).get("unpinned_talker_cpus"))


def doc_notes(doc: Mapping[str, Any], label: str) -> tuple[str, ...]:
    """Warnings for keys of a vllm-omni document that omnilab reads but does not apply, with the reason."""
    extra = ((doc.get("connectors") or {}).get(_CONNECTOR, {}) or {}).get("extra") or {}
    if "codec_left_context_frames" in extra:
        return (f"{label}: codec_left_context_frames={extra['codec_left_context_frames']!r} is not applied: omnilab's "
                f"code2wav carries its exact decoder state (conv contexts, the attention window) from chunk to chunk, "
                f"so no left context is recomputed and streaming equals offline",)
    return ()


def is_complete(doc: Mapping[str, Any], values: Mapping[str, Any]) -> bool:
    return all(f in values for f in FIELDS) and not _open_bind(doc, values)


def profile_fields_from_yaml(source: Any) -> tuple[dict[str, tuple[Any, str, str]], dict[str, Any]]:
    """A complete profile's fields ``{name: (value, reason, source)}`` and its other ``DeployProfile`` keywords,
    from YAML (path, text or mapping); ``DeployProfile.from_yaml`` builds the profile. Partial files:
    ``resolve_profile`` plans the missing fields."""
    doc, label = load_yaml_doc(source)
    values = values_from_doc(doc, label)
    missing = [f for f in FIELDS if f not in values]
    if _open_bind(doc, values):
        missing.insert(0, f"talker_cpus (VLLM_CPU_OMP_THREADS_BIND is {values['talker_cpus']!r})")
    if missing:
        raise ConfigError(f"{label} is not a complete deploy profile (missing {', '.join(missing)}); "
                          f"resolve_profile({label!r}) plans the missing fields")
    meta = doc.get("omnilab") or {}
    pinned = values["talker_cpus"] != NOBIND
    if not pinned:
        values["talker_cpus"] = FIELDS["talker_cpus"][1](meta["unpinned_talker_cpus"],
                                                         f"{label}: omnilab.unpinned_talker_cpus")
    reasons = meta.get("reasons") or {}
    fields = {}
    for f, v in ((f, v) for f, v in values.items() if f in FIELDS):
        r = reasons.get(f) or {}
        fields[f] = (v, str(r.get("reason") or f"from {label}"), str(r.get("source") or f"file {label}"))
    est = meta.get("estimate")
    try:
        estimate = StreamEstimate(**est) if est else None
    except TypeError as e:
        raise ConfigError(f"{label}: omnilab.estimate is malformed: {e}") from None
    return fields, dict(name=str(doc.get("name") or Path(label).stem), estimate=estimate,
                        memory_cap_bytes=meta.get("memory_cap_bytes"), hardware=str(meta.get("hardware") or ""),
                        warnings=tuple(meta.get("warnings") or ()) + doc_notes(doc, label), talker_pinned=pinned)
