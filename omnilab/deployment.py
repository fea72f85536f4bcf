"""Turn ``Pipeline.from_pretrained``'s deployment arguments into what the stages are built with.

Contract: ``prepare(checkpoint_dir, backend=, deploy_profile=, deploy=, dtype=, num_threads=,
max_concurrency=, chunk_schedule=, model_config=, quantization=) -> Deployment`` resolves the deploy profile (``"auto"``, a preset
name, a YAML path, a ``DeployProfile``, or None for none) for this machine and this checkpoint, folds
the explicit arguments into it (``dtype``/``num_threads``/``max_concurrency``/``quantization`` re-plan as argument
overrides; ``OMNILAB_*`` variables still win, as everywhere in ``omnilab.profiles``), and decides where
each stage runs:

- ``backend="eager"``: both stages in this process, the talker's torch threads from the profile.
- ``backend="vllm"``: ``deploy="inprocess"`` (engine in this process, lock-step), ``"workers"`` (vLLM
  engine-core + talker worker bound to the profile's talker CPUs, code2wav worker on its CPUs), or
  None = ``"auto"``: workers when the profile splits the CPUs between the stages (mode ``split``),
  in-process when they share them (mode ``shared``: on few cores a separate process only contends).
  An explicit ``VllmDeploy``/``VllmStageConfig``/dict is used as given.

In this process (the eager backend, ``deploy="inprocess"``) the stages take turns on this process's threads
(lock-step), so ``prepare`` makes the profile say what runs there (``fit_in_process``): an automatic
``code2wav_threads`` / ``code2wav_cpus`` become the talker's (source ``placement``, with the reason); explicit
values stay and are applied around each code2wav call. What cannot apply in a running process (CPU pinning
of its threads, ``LD_PRELOAD``) is listed in ``Deployment.not_applied`` with the reason, shown in
``pipe.deployment`` and returned by ``pipe.check_profile()``.

``quantization_row(checkpoint_dir, method, group_size, weights, compute)`` resolves ``quantization=`` for the
checkpoint's decode matrices (``omnilab.kernels.quant.quantization_choice``) and the row ``pipe.deployment`` shows.

``Deployment`` is what ``pipe.profile`` / ``pipe.deployment`` show. Plain Python: no vLLM import.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnilab.config import has_int4, parse_quantization, quantization_spelling as config_spelling
from omnilab.errors import ConfigError, InputError
from omnilab.hardware import format_cpulist
from omnilab.html_tables import html_table, key_value_table
from omnilab.models.tiny import TALKER_GEOMETRIES
from omnilab.profiles import DeployProfile, resolve_profile
from omnilab.profiles.planner import as_geometry
from omnilab.profiles.profile import Resolved
from omnilab.profiles.quantization import resolve_quantization
from omnilab.profiles.tensor_parallel import SHARED_NODE
from omnilab.stages._env import env_flag

DEPLOY_MODES = ("auto", "inprocess", "workers")


@dataclass(frozen=True)
class Deployment:
    """Where the stages run and with what: the applied profile (None without one) and the reasons."""
    backend: str
    profile: Any                   # omnilab.profiles.DeployProfile | None
    placement: str                 # "in-process" | "workers" | "custom"
    reason: str
    dtype: Any                     # what load_model gets (None = its own rule)
    num_threads: int | None        # torch threads of this process (None = leave as is)
    chunk_schedule: Any            # ChunkSchedule | None
    vllm_deploy: Any = None        # omnilab.stages.vllm.deploy.VllmDeploy, resolved once (vllm backend)
    gemv: Any = None               # omnilab.kernels.GemvChoice of this process (set by Pipeline.from_pretrained)
    hugepages: Any = None          # omnilab.tuning.hugepages.HugepagesChoice (idem)
    weights: Any = None            # omnilab.tuning.storage.WeightStorage of the talker (idem)
    snake: Any = None              # omnilab.kernels.snake.SnakeChoice for code2wav's activation (idem)
    code2wav_dtype: Any = None     # omnilab.tuning.code2wav_dtype.Code2WavDtype of code2wav's conv decoder (idem)
    code2wav_conv: Any = None      # omnilab.tuning.code2wav_conv.Code2WavConv: its fp32 conv path (idem)
    quantization: Any = None       # QuantizationRow of the talker's decode matrices (idem; None: not resolved)
    paths: Any = None              # omnilab.tuning.timing.LinearPaths: bf16 decode rows, prefill GEMMs (idem)
    kernels: tuple = ()            # omnilab.kernels.KernelRow of each kernel choice, the rows shown (idem)
    not_applied: tuple[tuple[str, str], ...] = ()  # (profile field, why it does not apply where the stage runs)

    def quantization_request(self, method: Any, group_size: Any) -> tuple[Any, Any]:
        """``(method, group_size)`` the loader quantizes with: the profile's ``quantization`` field where there is a
        profile (it folded the arguments in; ``OMNILAB_*`` wins there too), else the arguments as given."""
        if self.profile is None:
            return method, group_size
        return parse_quantization(self.profile.quantization.value, "profile quantization")

    def rows(self) -> list[tuple[str, str]]:
        p = self.profile
        out = [("backend", self.backend), ("placement", f"{self.placement}: {self.reason}"),
               ("profile", repr(p.name) if p is not None else "none")]
        if self.chunk_schedule is not None:
            c = self.chunk_schedule
            out.append(("chunks (frames)", "/".join(map(str, (c.first_frames, *c.ramp, c.steady_frames)))))
        if self.num_threads is not None:
            out.append(("client torch threads", str(self.num_threads)))
        out += [(k.title, f"{k.choice.label}: {k.choice.reason}") for k in self.kernels]  # kernels.kernel_choices
        if self.code2wav_dtype is not None:
            out.append(("code2wav dtype", f"{self.code2wav_dtype.label}: {self.code2wav_dtype.reason}"))
        if self.quantization is not None:
            out.append(("quantization", self.quantization.text()))
        out += [(f"not applied: {name}", why) for name, why in self.not_applied]
        return out

    def trace_meta(self) -> dict[str, Any]:
        """Run facts every trace and its CSV/Parquet/Perfetto exports carry (``Trace.meta``): placement, profile,
        quantization and the threads of each stage (None: the stage keeps its process's torch threads)."""
        q, v = self.quantization, self.vllm_deploy
        talker = v.talker.talker_threads if v is not None and v.talker.multiprocess else self.num_threads
        c2w = v.code2wav_threads if v is not None and v.code2wav_process else self.num_threads
        if v is None and self.profile is not None:  # eager: Code2WavStage takes the profile's code2wav threads
            c2w = self.profile.threads("code2wav")
        return {"placement": self.placement, "profile": self.profile.name if self.profile is not None else None,
                "quantization": q.choice.label if q is not None else "none",
                "talker_threads": talker, "code2wav_threads": c2w}

    def __repr__(self) -> str:
        name = self.profile.name if self.profile is not None else None
        return f"Deployment(backend={self.backend!r}, placement={self.placement!r}, profile={name!r})"

    def _repr_html_(self) -> str:
        body = html_table(["what", "value"], self.rows())
        return body + (self.profile._repr_html_() if self.profile is not None else "")


@dataclass(frozen=True)
class QuantizationRow:
    """What ``pipe.deployment`` shows about quantization: the choice, the decode matrices' bytes as they would be
    stored without it and with it, and the quantized-GEMV kernel (``omnilab.kernels.qgemv.qgemv_choice``)."""
    choice: Any                    # omnilab.kernels.quant.Quantization
    before_bytes: int              # decode matrices as stored unquantized (weights storage choice)
    after_bytes: int               # the same matrices as stored now (QuantizedWeight codes + scales)
    kernel: str | None             # QgemvChoice.label (None when not quantized)

    def text(self) -> str:
        q, mib = self.choice, 2 ** 20
        if not q.enabled:
            return f"none: {q.reason} ({self.before_bytes / mib:.1f} MiB of decode matrices)"
        g = (f"int4 talker group {q.group_size}, int8 predictor" if q.mixed else f"group {q.group_size}"
             if q.group_size else "per channel")
        return (f"{q.method} ({g}, {q.activations} activations), decode matrices {self.before_bytes / mib:.1f} -> "
                f"{self.after_bytes / mib:.1f} MiB, kernel {self.kernel}: {q.reason}")


def quantization_row(checkpoint_dir: Path, method: Any, group_size: Any, weights: Any, compute: Any,
                     config: Any = None) -> QuantizationRow:
    """:func:`omnilab.kernels.quant.quantization_choice` of ``method`` / ``group_size`` for the talker's decode matrices
    of ``checkpoint_dir`` (file header: names, shapes, dtypes) and its row (``.choice``: the ``Quantization``).
    ``weights``: the ``WeightStorage`` (bf16 kept or not), ``compute``: the compute torch dtype; ``config``: the
    parsed ``config.json`` (its ``quantization_config``, not read again)."""
    import torch

    from omnilab.checkpoint.quantized import quantization_for  # lazy: torch
    from omnilab.kernels.quant import packed_nbytes  # lazy: torch
    from omnilab.tuning.storage import talker_streamed_name  # lazy: torch

    # a pack-quantized checkpoint: its own quantization, its packed matrices seen at their [N, K] (docs/quantization.md)
    choice, index = quantization_for(Path(checkpoint_dir), method, group_size, config)
    names = [k for k in index.where if k.startswith("talker.") and talker_streamed_name(k.removeprefix("talker."))]
    before = after = 0
    for full in names:
        name = full.removeprefix("talker.")
        shape, fd = index.shape(full), index.dtype(full)
        stored = fd if (weights is not None and weights.keeps_bf16(name, fd)) or not fd.is_floating_point else compute
        plain = int(torch.Size(shape).numel()) * torch.empty((), dtype=stored).element_size()
        before += plain
        packed = choice.enabled and (choice.names is None or choice.selects(name))  # a checkpoint's: those it packs
        fmt = choice.format_for(name) if packed else None
        after += packed_nbytes(tuple(shape), fmt, choice.group_size if fmt == "int4" else None) if packed else plain
    kernel = None
    if choice.enabled:
        from omnilab.kernels.qgemv import qgemv_choice  # lazy: torch
        kernel = qgemv_choice().label
    return QuantizationRow(choice, before, after, kernel)


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None:
        return None
    from omnilab.checkpoint.load import resolve_dtype  # lazy: torch
    d, _ = resolve_dtype(dtype)
    return "float32" if str(d) == "torch.float32" else "bfloat16"


def quantization_spelling(quantization: Any, group_size: Any) -> str | None:
    """``from_pretrained``'s ``quantization=`` / ``quant_group_size=`` as one profile spelling (None: not given):
    ``("int4", 64)`` -> ``"int4-g64"``; a group with another method is a ``ConfigError``."""
    if quantization is None and group_size is None:
        return None
    method, group = parse_quantization(quantization, "quantization")
    if group_size is not None:
        if not has_int4(method) or (group is not None and group != group_size):
            raise ConfigError(f"quant_group_size={group_size!r} applies to int4 only and must agree with the "
                              f"spelling (quantization={quantization!r}); int8 has one scale per output channel")
        parse_quantization(f"int4-g{group_size}", "quant_group_size")  # names the accepted sizes
        group = group_size
    return config_spelling(method, group)


def resolve_pipeline_profile(checkpoint_dir: Path, spec: Any, *, dtype: Any = None, num_threads: int | None = None,
                             max_concurrency: int | None = None, model_config: Any = None,
                             quantization: str | None = None):
    """The ``DeployProfile`` for ``from_pretrained``'s ``deploy_profile`` and explicit arguments (or None).
    ``model_config``: the checkpoint's geometry (see ``omnilab.profiles.planner.as_geometry``; a ``ModelGeometry``
    from configs already parsed), None = read from ``checkpoint_dir``."""
    if spec is None:
        if max_concurrency is not None:
            raise InputError("max_concurrency= sizes the deploy profile; it needs deploy_profile (e.g. 'auto')")
        return None

    name = _dtype_name(dtype)
    if isinstance(spec, DeployProfile):
        profile = resolve_profile(spec)
        if num_threads is not None and num_threads != profile.threads("talker"):
            raise InputError(f"num_threads={num_threads} contradicts the given DeployProfile's talker_threads="
                             f"{profile.threads('talker')}; change the profile (plan(overrides=...)) or drop num_threads")
        if max_concurrency is not None and max_concurrency > profile.max_num_seqs.value:
            raise InputError(f"max_concurrency={max_concurrency} is above the given DeployProfile's max_num_seqs="
                             f"{profile.max_num_seqs.value}")
        if quantization is not None:
            q = resolve_quantization(as_geometry(model_config if model_config is not None else checkpoint_dir),
                                     quantization)
            profile = profile.replace(quantization=q) if q.value != profile.quantization.value else profile
        return profile.replace(dtype=name) if name and name != profile.dtype.value else profile
    if not (isinstance(spec, (str, Path)) or hasattr(spec, "keys")):
        raise InputError(f"deploy_profile {spec!r} is not understood; accepted: 'auto', a preset name, a YAML path, "
                         "a DeployProfile, or None")
    overrides = {k: v for k, v in (("dtype", name), ("talker_threads", num_threads), ("quantization", quantization))
                 if v is not None}
    kwargs: dict[str, Any] = {"overrides": overrides} if overrides else {}
    if name is None:  # an open dtype follows the timing of this machine's linear paths (OMNILAB_PLAN_TIMING)
        from omnilab.tuning.code2wav_timing import with_code2wav_times  # lazy: torch
        from omnilab.tuning.timing import path_times  # lazy: torch
        kwargs["path_times"] = with_code2wav_times(path_times())  # + code2wav's bf16/fp32 timing where bf16 is native
    if max_concurrency is not None:
        kwargs["max_concurrency"] = max_concurrency
    geometry = as_geometry(model_config if model_config is not None else checkpoint_dir)
    return resolve_profile(spec, model_config=geometry, **kwargs)


def _chunk_schedule(profile):
    from omnilab.models.code2wav_stream import ChunkSchedule  # lazy: torch
    return ChunkSchedule(first_frames=profile.first_chunk_frames.value, ramp=profile.chunk_ramp_frames.value,
                         steady_frames=profile.steady_chunk_frames.value)


def prepare(checkpoint_dir: Path, *, backend: str, deploy_profile: Any = "auto", deploy: Any = None,
            dtype: Any = None, num_threads: int | None = None, max_concurrency: int | None = None,
            chunk_schedule: Any = None, model_config: Any = None, quantization: str | None = None) -> Deployment:
    """Resolve profile and placement (see the module docstring). ``model_config``: the checkpoint's geometry
    when the caller has parsed its configs already (``ModelGeometry``; None = read from ``checkpoint_dir``)."""
    if num_threads is not None and (not isinstance(num_threads, int) or isinstance(num_threads, bool)
                                    or num_threads < 1):
        raise InputError(f"num_threads must be a positive integer; got {num_threads!r}")
    if max_concurrency is not None and (not isinstance(max_concurrency, int) or max_concurrency < 1):
        raise InputError(f"max_concurrency must be a positive integer; got {max_concurrency!r}")
    for var in ("OMNILAB_CPU_INDUCTOR", "VLLM_OMNI_CPU_INDUCTOR", "OMNILAB_VLLM_PREDICTOR_PER_ROW"):
        env_flag(None, var)  # a bad word is a ConfigError on every backend (eager ignores a good one)
    if isinstance(deploy, str) and deploy not in DEPLOY_MODES + ("multiprocess",):
        raise InputError(f"deploy {deploy!r} is not known; accepted: {', '.join(DEPLOY_MODES)} (alias "
                         "'multiprocess' for 'workers'), a VllmDeploy, "
                         "a VllmStageConfig or a dict of its fields")
    if backend == "eager" and deploy not in (None, "auto", "inprocess"):
        raise InputError(f"deploy={deploy!r} applies to backend='vllm' only (the eager backend runs in this process)")
    profile = resolve_pipeline_profile(checkpoint_dir, deploy_profile, dtype=dtype, num_threads=num_threads,
                                       max_concurrency=max_concurrency, model_config=model_config,
                                       quantization=quantization)
    if backend == "vllm" and profile is not None and profile.talker_tp_size.value > 1:
        import warnings  # ranks on one NUMA node run (testing, study) but gain nothing: said where it runs

        for note in profile.warnings:
            if SHARED_NODE in note:
                warnings.warn(f"omnilab: {note}", UserWarning, stacklevel=3)
    if backend == "eager":
        mode, why = "inprocess", "the eager backend runs both stages in this process"
    elif deploy is not None and not isinstance(deploy, str):  # an explicit VllmDeploy / VllmStageConfig / dict
        mode, why = "custom", "deploy= given explicitly"
    elif deploy in (None, "auto"):
        if profile is None:
            mode, why = "inprocess", "no deploy profile: the engine runs in this process"
        elif profile.talker_tp_size.value > 1:
            mode, why = "workers", (f"the profile's talker has {profile.talker_tp_size.value} tensor-parallel "
                                    f"ranks, one vLLM worker process each")
        elif profile.mode.value == "split":
            mode, why = "workers", "the profile gives each stage its own CPUs (mode split)"
        else:
            mode, why = "inprocess", ("the profile has the stages share CPUs (mode shared): separate worker "
                                      "processes would only contend for them; deploy='workers' forces them")
    else:
        mode = "workers" if deploy == "multiprocess" else deploy
        why = f"deploy={deploy!r}"
    not_applied: tuple[tuple[str, str], ...] = ()
    if profile is not None and mode == "inprocess":
        if backend == "vllm" and profile.talker_tp_size.value > 1:
            raise InputError(f"deploy={deploy!r}: the profile's talker has {profile.talker_tp_size.value} "
                             f"tensor-parallel ranks, one vLLM worker process each; use deploy='workers' or 'auto'")
        profile, not_applied = fit_in_process(profile)
        if profile.talker_tp_size.value > 1:  # the eager backend: one talker, in this process
            not_applied += (("talker_tp_size", "the eager backend runs one talker in this process; tensor "
                             "parallelism runs with backend='vllm' in worker processes"),)
    sched = chunk_schedule if chunk_schedule is not None else (_chunk_schedule(profile) if profile else None)
    load_dtype = profile.dtype.value if profile is not None else dtype
    threads = num_threads if profile is None else profile.threads("talker")
    if backend == "eager":
        return Deployment(backend, profile, "in-process", why, load_dtype, threads, sched, not_applied=not_applied)
    if mode == "custom":  # resolved here, once: the stage builders get the VllmDeploy, not the spec
        from omnilab.stages.vllm.deploy import resolve_deploy  # lazy: torch
        return Deployment(backend, profile, "custom", why, load_dtype, num_threads, sched,
                          vllm_deploy=resolve_deploy(deploy))
    if profile is None:
        from omnilab.stages.vllm.deploy import VllmDeploy, VllmStageConfig  # lazy: torch
        spec = VllmDeploy.multiprocess_default() if mode == "workers" else VllmDeploy(
            VllmStageConfig(talker_threads=num_threads))
    else:
        from omnilab.stages.vllm.deploy import VllmDeploy  # lazy: torch
        spec = VllmDeploy.from_profile(profile, multiprocess=mode == "workers")
    placement = "workers" if mode == "workers" else "in-process"
    # In workers the talker's threads live in its process; this process keeps its own setting.
    return Deployment(backend, profile, placement, why, load_dtype,
                      None if mode == "workers" else threads, sched, vllm_deploy=spec, not_applied=not_applied)


def fit_in_process(profile, affinity: set[int] | None = None):
    """``(profile, not_applied)`` for stages that run in this process, taking turns on its threads.

    An automatic stage layout (mode, code2wav threads and CPU list, planned for a code2wav process beside the
    talker) becomes ``shared`` on the talker's threads: in lock-step the talker is idle while code2wav runs,
    so code2wav gets all its threads.
    Explicit values (environment, argument, preset, file) stay and are applied around each code2wav call.
    ``not_applied`` names what a running process cannot honour, with the reason."""
    c2w_t, c2w_c, mode = profile.code2wav_threads, profile.code2wav_cpus, profile.mode
    both = (profile.talker_threads.source, profile.talker_cpus.source, c2w_t.source, c2w_c.source, mode.source)
    if mode.value == "split" and set(both) == {"auto"} and profile.talker_tp_size.value == 1:
        # an automatic split gave the talker only its share of the cores, for a code2wav process running beside it
        cpus = tuple(sorted(set(profile.cpus("talker")) | set(c2w_c.value)))
        why = (f"{len(cpus)}: in this process the stages take turns (lock-step), so the talker takes every core the "
               f"plan's split layout gave the two stages (CPUs {format_cpulist(cpus)}; talker "
               f"{profile.threads('talker')} + code2wav {c2w_t.value} thread(s), for a code2wav process beside it)")
        fields = dict(mode="shared", talker_threads=len(cpus), talker_cpus=(cpus,), code2wav_threads=len(cpus),
                      code2wav_cpus=cpus)
        profile = profile.replace(**{k: Resolved(v, why, "placement") for k, v in fields.items()})
        c2w_t, c2w_c, mode = profile.code2wav_threads, profile.code2wav_cpus, profile.mode
    nt, talker_cpus = profile.threads("talker"), profile.cpus("talker")
    out = []
    fitted = (mode.value, c2w_t.value, set(c2w_c.value)) == ("shared", nt, set(talker_cpus))
    explicit_split = mode.value == "split" and mode.source != "auto"
    if not fitted and {c2w_t.source, c2w_c.source} == {"auto"} and not explicit_split:
        lock_step = (f"in this process the stages take turns (lock-step) on the talker's {nt} thread(s), so code2wav "
                     f"uses them all (the plan's {mode.value} layout with code2wav on {c2w_t.value} thread(s), CPU "
                     f"{format_cpulist(c2w_c.value)}, was for a code2wav process running beside the talker)")
        profile = profile.replace(mode=mode if mode.value == "shared" else Resolved("shared", lock_step, "placement"),
                                  code2wav_threads=Resolved(nt, lock_step, "placement"),
                                  code2wav_cpus=Resolved(tuple(talker_cpus), lock_step, "placement"))
    elif mode.value == "split":
        out.append(("mode", f"'split' ({mode.source}) gives each stage its own CPUs, but in this process the stages "
                    f"take turns on the same threads; deploy='workers' runs them side by side"))
    aff = set(os.sched_getaffinity(0)) if affinity is None else set(affinity)
    for stage in ("talker", "code2wav"):
        cpus = set(profile.cpus(stage))
        if cpus != aff:
            out.append((f"{stage}_cpus", f"{format_cpulist(cpus)} planned, but in-process stages run on this "
                        f"process's threads, which omnilab does not pin (they may run on CPUs {format_cpulist(aff)}); "
                        f"deploy='workers' binds each stage to its CPUs"))
    if profile.preload.value:
        out.append(("preload", f"LD_PRELOAD={':'.join(profile.preload.value)} applies only to processes started "
                    f"with it; this process is already running (deploy='workers' starts its workers with it)"))
    return profile, tuple(out)


class PipelineRepr:
    """``Pipeline``'s text repr and notebook table (checkpoint, variant, backend, deploy, dtype, threads), kept out
    of ``pipeline.py``; reads ``self.model``, ``self.backend`` and ``self.deployment``."""

    def _describe(self) -> list[tuple[str, str]]:
        c, dep = self.model.config, self.deployment
        t = c.talker  # the size by geometry: a tiny random checkpoint says "0b6" in its config.json
        size = next((name for name, g in TALKER_GEOMETRIES.items()
                     if (g["hidden"], g["layers"]) == (t.hidden_size, t.num_hidden_layers)), c.tts_model_size)
        p = dep.profile if dep is not None else None
        if p is not None:
            threads = f"talker {p.threads('talker')}, code2wav {p.threads('code2wav')}"
        else:
            threads = str(dep.num_threads) if dep is not None and dep.num_threads else "torch default"
        return [("checkpoint", str(self.model.path)), ("variant", f"{size} {c.tts_model_type}"),
                ("backend", self.backend), ("deploy", dep.placement if dep is not None else "custom"),
                ("dtype", str(self.model.dtype).replace("torch.", "")), ("threads", threads)]

    def __repr__(self) -> str:
        d = dict(self._describe())
        where = f", {d['deploy']}" if self.deployment is not None else ""
        return (f"Pipeline({d['variant']}, backend={self.backend!r}{where}, dtype={d['dtype']}, "
                f"path={d['checkpoint']!r})")

    def _repr_html_(self) -> str:
        return "<div><b>Pipeline</b>" + key_value_table(dict(self._describe())) + "</div>"
