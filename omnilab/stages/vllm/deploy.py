"""Build the two stages of the vLLM backend: the talker engine and the code2wav stage.

Contract:
- ``VllmDeploy`` (frozen) says how: the talker engine (:class:`~omnilab.stages.vllm.engine.VllmStageConfig`)
  and where code2wav runs: ``"process"`` (:class:`~omnilab.stages.code2wav.worker.Code2WavWorker`, its own
  CPUs/threads), ``"inprocess"`` (:class:`~omnilab.stages.code2wav.stage.Code2WavStage`), or ``"auto"``
  (a process exactly when the talker is multiprocess).
- ``VllmDeploy.from_profile(profile)`` takes a :class:`omnilab.profiles.DeployProfile`: the engine's sizes
  from ``profile.engine_args("talker")``, the environment of the talker's and code2wav's processes from
  ``profile.to_env(stage)`` (workers start with exactly those values), CPU lists and threads.
  ``VllmDeploy.multiprocess_default()`` is the no-profile default only. ``resolve_deploy(spec)`` accepts
  None (in-process talker), ``"multiprocess"``, a ``VllmDeploy`` (returned as is), a ``VllmStageConfig``, a
  ``DeployProfile`` or a dict of ``VllmStageConfig`` fields plus ``code2wav``/``code2wav_cpus``/``code2wav_threads``.
- ``client_load_options(deploy)`` says which modules the client must load (``load_model`` keywords: not
  the talker when it runs in a worker process, not code2wav when that does). ``build_stages(model, deploy)
  -> (talker_stage, code2wav_stage)``; it also drops (``= None``) modules a worker holds, if they were
  loaded, so the weights never live twice.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from omnilab.errors import InputError
from omnilab.profiles.overrides import parse_bind
from omnilab.stages.code2wav.stage import Code2WavStage
from omnilab.stages.code2wav.worker import Code2WavWorker
from omnilab.stages.vllm.config import VllmStageConfig
from omnilab.checkpoint.worker_weights import release_memory
from omnilab.stages.vllm.engine import VllmTalkerStage

CODE2WAV_MODES = ("auto", "process", "inprocess")


@dataclass(frozen=True)
class VllmDeploy:
    talker: VllmStageConfig = field(default_factory=VllmStageConfig)
    code2wav: str = "auto"
    code2wav_cpus: tuple[int, ...] | None = None
    code2wav_threads: int | None = None
    code2wav_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.code2wav not in CODE2WAV_MODES:
            raise InputError(f"code2wav {self.code2wav!r}; accepted: {', '.join(CODE2WAV_MODES)}")

    @property
    def code2wav_process(self) -> bool:
        return self.code2wav == "process" or (self.code2wav == "auto" and self.talker.multiprocess)

    @classmethod
    def multiprocess_default(cls, environ: Mapping[str, str] | None = None) -> "VllmDeploy":
        """The no-profile default (``deploy_profile=None`` with ``deploy="workers"``, or ``"multiprocess"``):
        the talker worker on ``VLLM_CPU_OMP_THREADS_BIND``'s CPU lists when the environment sets them (one
        tensor-parallel rank per ``|``-separated list), else on all CPUs of this process's mask but the last;
        code2wav on the last CPU not given to the talker (2+ CPUs). With a profile, :meth:`from_profile` is the
        only road."""
        environ = os.environ if environ is None else environ
        cpus = sorted(os.sched_getaffinity(0))
        raw = (environ.get("VLLM_CPU_OMP_THREADS_BIND") or "").strip()
        bind = parse_bind(raw, "VLLM_CPU_OMP_THREADS_BIND") if raw else None
        if isinstance(bind, tuple):  # one list per tensor-parallel rank, of equal length (one thread per CPU)
            ranks = tuple(tuple(r) for r in bind)
            if len({len(r) for r in ranks}) != 1:
                raise InputError(f"VLLM_CPU_OMP_THREADS_BIND={raw!r}: tensor-parallel ranks need CPU lists of equal "
                                 f"length (one thread per listed CPU), got {[len(r) for r in ranks]}")
            used = {c for r in ranks for c in r}
            rest = [c for c in cpus if c not in used]
            c2w = (rest[-1],) if rest else (ranks[-1][-1],)
            return cls(VllmStageConfig(multiprocess=True, talker_cpus=ranks if len(ranks) > 1 else ranks[0],
                                       tensor_parallel_size=len(ranks), talker_threads=len(ranks[0])),
                       code2wav="process", code2wav_cpus=c2w, code2wav_threads=1)
        if len(cpus) < 2:
            return cls(VllmStageConfig(multiprocess=True), code2wav="process")
        talker = tuple(cpus[: max(1, len(cpus) - 1)])
        return cls(VllmStageConfig(multiprocess=True, talker_cpus=talker, talker_threads=len(talker)),
                   code2wav="process", code2wav_cpus=(cpus[-1],), code2wav_threads=1)

    @classmethod
    def from_profile(cls, profile: Any, *, multiprocess: bool = True, **talker_overrides: Any) -> "VllmDeploy":
        """From an ``omnilab.profiles.DeployProfile``, the one road from a profile to the processes: the talker
        engine's sizes from ``profile.engine_args("talker")``; with ``multiprocess``, the environment its
        processes start with is ``profile.to_env("talker")`` and the code2wav worker's ``to_env("code2wav")``
        (what ``to_env`` shows is what the workers get); CPU lists and threads from the profile."""
        args = profile.engine_args("talker")
        tp = int(args.get("tensor_parallel_size", 1))
        if tp > 1 and not multiprocess:
            raise InputError(f"the profile's talker has {tp} tensor-parallel ranks, one vLLM worker process each: it "
                             f"runs with deploy='workers' (or 'auto'), not in this process")
        preload = tuple(profile.preload.value or ())
        pinned = profile.talker_pinned  # False: nobind, the worker's threads are not pinned
        ranks = tuple(tuple(r) for r in profile.talker_cpus.value)  # one CPU list per tensor-parallel rank
        talker = VllmStageConfig(
            multiprocess=multiprocess, talker_cpus=(ranks if tp > 1 else ranks[0]) if multiprocess and pinned else None,
            tensor_parallel_size=tp, pin_threads=pinned, talker_threads=profile.threads("talker"),
            kv_cache_memory_bytes=int(args["kv_cache_memory_bytes"]), max_num_seqs=int(args["max_num_seqs"]),
            max_model_len=int(args["max_model_len"]), block_size=int(args["block_size"]),
            enforce_eager=bool(args["enforce_eager"]), preload=preload if multiprocess else (),
            env=profile.to_env("talker") if multiprocess else {}, **talker_overrides)
        return cls(talker, code2wav="process" if multiprocess else "inprocess",
                   code2wav_cpus=tuple(profile.cpus("code2wav")), code2wav_threads=profile.threads("code2wav"),
                   code2wav_env=profile.to_env("code2wav") if multiprocess else {})


def resolve_deploy(spec: Any = None) -> VllmDeploy:
    """A ``VllmDeploy`` for ``spec`` (see the module docstring); a ``VllmDeploy`` comes back as is, so resolve a
    spec once and pass the result on (``deployment.prepare`` does)."""
    if spec is None:
        return VllmDeploy()
    if isinstance(spec, VllmDeploy):
        return spec
    if isinstance(spec, VllmStageConfig):
        return VllmDeploy(spec)
    if spec == "multiprocess":
        return VllmDeploy.multiprocess_default()
    if isinstance(spec, Mapping):
        spec = dict(spec)
        top = {k: spec.pop(k) for k in ("code2wav", "code2wav_cpus", "code2wav_threads") if k in spec}
        if "talker_cpus" in spec and spec["talker_cpus"] is not None:
            spec["talker_cpus"] = tuple(spec["talker_cpus"])
        if "code2wav_cpus" in top and top["code2wav_cpus"] is not None:
            top["code2wav_cpus"] = tuple(top["code2wav_cpus"])
        return VllmDeploy(VllmStageConfig(**spec), **top)
    if hasattr(spec, "cpus") and hasattr(spec, "values"):  # omnilab.profiles.DeployProfile
        return VllmDeploy.from_profile(spec)
    raise InputError(f"deploy {spec!r} is not understood; accepted: None, 'multiprocess', VllmDeploy, "
                     "VllmStageConfig, a DeployProfile or a dict of VllmStageConfig fields")


def client_load_options(deploy: Any = None) -> dict[str, bool]:
    """``load_model`` keywords for the client process: modules that run in a worker are not loaded here."""
    d = resolve_deploy(deploy)
    return {"load_talker": not d.talker.multiprocess, "load_code2wav": not d.code2wav_process}


def build_stages(model, deploy: Any = None, code2wav_dtype: Any = None):
    """``(talker_stage, code2wav_stage)`` for the vLLM backend; ``code2wav_dtype``: the client's
    ``omnilab.tuning.code2wav_dtype.Code2WavDtype`` for code2wav, in this process or its worker (None: fp32)."""
    d = resolve_deploy(deploy)
    code2wav = None
    if d.code2wav_process:
        code2wav = Code2WavWorker(model.path, cpus=d.code2wav_cpus, threads=d.code2wav_threads,
                                  env=dict(d.code2wav_env), dtype=code2wav_dtype)
    if d.talker.multiprocess:
        model.talker = None  # the worker process loads its own copy; do not hold two
    if code2wav is not None:
        model.code2wav = None  # likewise for the code2wav worker
    release_memory()
    try:
        talker = VllmTalkerStage(model, d.talker)
    except BaseException:
        if code2wav is not None:
            code2wav.close()
        raise
    if code2wav is None:
        code2wav = Code2WavStage(model.code2wav, threads=d.code2wav_threads, dtype=code2wav_dtype)
    return talker, code2wav


def describe(deploy: Any = None) -> dict[str, Any]:
    d = resolve_deploy(deploy)
    return {"talker": dataclasses.asdict(d.talker), "code2wav": "process" if d.code2wav_process else "inprocess",
            "code2wav_cpus": d.code2wav_cpus, "code2wav_threads": d.code2wav_threads,
            "code2wav_env": dict(d.code2wav_env)}
