"""The configurations ``omnilab bench`` runs side by side: names, how each is built, what one run of it measures.

A configuration is a base and optional ``+modifier`` suffixes (combinable), e.g. ``vllm+torch-gemv+compiled``:

- bases (``BASES``): ``eager`` (plain torch in this process), ``vllm`` (vLLM's engine in this process,
  lock-step, code2wav in this process), ``vllm-workers`` (engine core + talker worker + code2wav worker;
  without ``--talker-cpus``/``--code2wav-cpus``, CPUs and threads from the auto deploy profile, as users get).
- modifiers (``MODIFIERS``): ``+compiled`` (vLLM's torch.compile path for the talker, ``enforce_eager=False``),
  ``+inductor`` (the code predictor's MLPs compiled by inductor), and environment switches set while the
  configuration is built (worker processes inherit them): ``+torch-gemv``, ``+avx2-gemv``, ``+avx2-kernels``,
  ``+torch-snake``, ``+fp32-weights``, ``+huge-pages``, ``+int8`` / ``+int4`` / ``+int4-g32`` / ``+int4-g64`` (decode
  matrices quantized at load), ``+int8-acts`` / ``+int16-acts`` / ``+fp32-acts`` (their activations); ``+fp32-code2wav`` /
  ``+bf16-code2wav`` set code2wav's dtype (``OMNILAB_CODE2WAV_DTYPE``), ``+taps-conv`` / ``+direct-conv`` its fp32
  conv path (``OMNILAB_CODE2WAV_CONV``); ``+tp2`` (vllm-workers only) runs two
  tensor-parallel talker ranks (``OMNILAB_TALKER_TP=2``); ``+fp32`` / ``+bf16`` / ``+auto`` ask for that compute
  dtype (``+auto``: what a user who passes no dtype gets) instead of ``--dtype``. ``expand`` crosses configurations
  with ``--quantization`` and ``--dtype`` lists. ``vllm-compiled``, ``vllm-inductor`` and ``vllm-workers-inductor``
  (the former script's names) are aliases.

``measure`` runs one round of a built configuration: a warm-up request, then each concurrency point
(``drivers.run_point``; 1 stream always, the base of the N-stream ratios) with the run-queue wait of each
window; ``derive`` turns a round into the flat figures of a table row (``results.table_keys()``); ``median_row``
takes the median of each figure over rounds.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from omnilab import settings
from omnilab.bench import drivers as drv
from omnilab.bench.floors import decode_bytes_by_part
from omnilab.bench.memory import schedstat_snapshot, wait_pct
from omnilab.bench.results import table_keys
from omnilab.deployment import prepare
from omnilab.stages.vllm.config import VllmStageConfig

BASES = {
    "eager": "plain torch in this process (talker + predictor + code2wav), --threads torch threads",
    "vllm": "vLLM engine in this process (lock-step), code2wav in this process, --threads torch threads",
    "vllm-workers": "vLLM engine-core + talker worker + code2wav worker processes; CPUs and threads from the auto "
                    "deploy profile unless --talker-cpus / --code2wav-cpus (--threads = talker threads)",
}
MODIFIERS: dict[str, dict[str, str]] = {
    "+compiled": {},  # vLLM's torch.compile path for the talker (vllm bases only)
    "+inductor": {},  # the code predictor's MLPs compiled by inductor (vllm bases only)
    "+torch-gemv": {"OMNILAB_CPU_GEMV": "torch"},  # every linear on torch (MKL), fp32 copies of the decode matrices
    "+avx2-gemv": {"OMNILAB_CPU_GEMV": "omnilab-avx2"},  # the AVX2 build of the GEMV kernel
    "+avx2-kernels": {"OMNILAB_CPU_GEMV": "omnilab-avx2", "OMNILAB_CPU_SNAKE": "omnilab-avx2"},  # both AVX2 builds
    "+torch-snake": {"OMNILAB_CPU_SNAKE": "torch"},  # code2wav's SnakeBeta as torch's 4 passes
    "+fp32-weights": {"OMNILAB_DECODE_WEIGHTS": "compute"},  # fp32 copies of the bf16 decode matrices
    "+huge-pages": {"OMNILAB_HUGEPAGES": "on"},  # decode weights in a huge-page arena
    "+int8": {"OMNILAB_QUANTIZATION": "int8"},  # decode matrices quantized at load: int8 per output row
    "+int4": {"OMNILAB_QUANTIZATION": "int4"},  # ... int4, groups of 128 along K (or the largest that divides K)
    "+int4-g32": {"OMNILAB_QUANTIZATION": "int4-g32"}, "+int4-g64": {"OMNILAB_QUANTIZATION": "int4-g64"},
    "+int4-all": {"OMNILAB_QUANTIZATION": "int4-all"},  # int4 code predictor too (int4: int8 predictor)
    "+int4-all-g32": {"OMNILAB_QUANTIZATION": "int4-all-g32"}, "+int4-all-g64": {"OMNILAB_QUANTIZATION": "int4-all-g64"},
    "+int8-acts": {"OMNILAB_QUANT_ACTIVATIONS": "int8"},  # quantized matrices' activations: int8 per row (VNNI)
    "+int16-acts": {"OMNILAB_QUANT_ACTIVATIONS": "int16"},  # ... int16 per row (VNNI vpdpwssd)
    "+fp32-acts": {"OMNILAB_QUANT_ACTIVATIONS": "fp32"},  # ... fp32
    "+fp32": {}, "+bf16": {}, "+auto": {},  # the compute dtype asked for (DTYPE_SUFFIXES; default: --dtype)
    "+fp32-code2wav": {"OMNILAB_CODE2WAV_DTYPE": "float32"},  # code2wav's dtype (default: its auto rule)
    "+bf16-code2wav": {"OMNILAB_CODE2WAV_DTYPE": "bfloat16"},
    "+taps-conv": {"OMNILAB_CODE2WAV_CONV": "taps"},  # code2wav's fp32 convs as per-tap GEMMs (default: auto)
    "+direct-conv": {"OMNILAB_CODE2WAV_CONV": "direct"},  # ... all as oneDNN's direct convolution
    "+tp2": {"OMNILAB_TALKER_TP": "2"},  # two tensor-parallel talker ranks from the auto profile (vllm-workers only)
}
DTYPE_SUFFIXES = {"+fp32": "float32", "+bf16": "bfloat16", "+auto": "auto"}  # "auto": dtype=None, the planner's rule
ALIASES = {"vllm-compiled": "vllm+compiled", "vllm-inductor": "vllm+inductor",
           "vllm-workers-inductor": "vllm-workers+inductor"}
MODIFIER_VARS = tuple(sorted({v for env in MODIFIERS.values() for v in env}))
ISA_VARS = ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")  # caps to emulate an AVX2 CPU


@dataclass(frozen=True)
class Config:
    """One configuration: ``name`` as given, its ``base``, compile switches and modifier environment."""
    name: str
    base: str
    compile_talker: bool = False
    compile_predictor: bool = False
    env: dict = field(default_factory=dict)
    dtype: str | None = None      # the compute dtype asked for (DTYPE_SUFFIXES); None: the bench's --dtype

    def dtype_arg(self, default: str) -> str | None:
        """``from_pretrained``'s ``dtype=``: the suffix's or ``default``; ``auto`` -> None (the planner's rule)."""
        d = self.dtype or default
        return None if d == "auto" else d

    @property
    def workers(self) -> bool:
        return self.base == "vllm-workers"


def parse_config(name: str, compile_talker: bool = False) -> Config:
    """``"vllm+torch-gemv+compiled"`` -> ``Config(base="vllm", compile_talker=True, env={OMNILAB_CPU_GEMV: torch})``.
    ``compile_talker`` (``--compile on``) adds ``+compiled`` to every vllm configuration."""
    full = name.strip()
    base, *mods = ALIASES.get(full.split("+")[0], full.split("+")[0]).split("+")
    mods = mods + full.split("+")[1:]
    if base not in BASES:
        raise ValueError(f"configuration {name!r}: unknown base {base!r}; accepted: {', '.join(BASES)} (aliases "
                         f"{', '.join(ALIASES)}), each with optional suffixes {', '.join(MODIFIERS)}")
    env: dict[str, str] = {}
    for m in mods:
        if "+" + m not in MODIFIERS:
            raise ValueError(f"configuration {name!r}: unknown suffix '+{m}'; accepted: {', '.join(MODIFIERS)}")
        env.update(MODIFIERS["+" + m])
    compiled, inductor = "compiled" in mods, "inductor" in mods
    if base == "eager" and (compiled or inductor):
        raise ValueError(f"configuration {name!r}: +compiled / +inductor apply to the vllm bases only")
    if "tp2" in mods and base != "vllm-workers":
        raise ValueError(f"configuration {name!r}: +tp2 (tensor-parallel talker ranks, one worker process each) "
                         f"applies to vllm-workers only")
    dtypes = [DTYPE_SUFFIXES["+" + m] for m in mods if "+" + m in DTYPE_SUFFIXES]
    if len(dtypes) > 1:
        raise ValueError(f"configuration {name!r}: more than one dtype suffix ({', '.join(DTYPE_SUFFIXES)})")
    return Config(full, base, compiled or (compile_talker and base != "eager"), inductor, env,
                  dtypes[0] if dtypes else None)


QUANT_SUFFIX = {"none": "", "int8": "+int8", "int4": "+int4", "int4-g32": "+int4-g32", "int4-g64": "+int4-g64",
                "int4-g128": "+int4", "int4-all": "+int4-all", "int4-all-g32": "+int4-all-g32",
                "int4-all-g64": "+int4-all-g64", "int4-all-g128": "+int4-all"}
DTYPE_SUFFIX = {"float32": "+fp32", "fp32": "+fp32", "bfloat16": "+bf16", "bf16": "+bf16", "auto": "+auto"}


def expand(configs: tuple[str, ...], quantizations: tuple[str, ...] = (),
           dtypes: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every configuration crossed with the ``--quantization`` list (``none`` adds no suffix) and, when more than one
    dtype is listed or the one listed is ``auto``, the ``--dtype`` list (a suffix each; one concrete dtype is the
    bench's own dtype): ``expand(("vllm",), ("none", "int4"), ("auto", "float32"))`` -> ``vllm+auto, vllm+fp32,
    vllm+int4+auto, vllm+int4+fp32``; ``expand(("eager",), (), ("auto",))`` -> ``eager+auto``."""
    bad = [q for q in quantizations if q not in QUANT_SUFFIX] + [d for d in dtypes if d not in DTYPE_SUFFIX]
    if bad:
        raise ValueError(f"--quantization/--dtype value(s) {', '.join(map(repr, bad))}; accepted: quantization "
                         f"{', '.join(QUANT_SUFFIX)}; dtype auto, float32, bfloat16")
    dsuf = [DTYPE_SUFFIX[d] for d in dtypes] if len(dtypes) > 1 or tuple(dtypes) == ("auto",) else [""]
    return tuple(dict.fromkeys(c + QUANT_SUFFIX[q] + d for c in configs for q in (quantizations or ("none",))
                               for d in dsuf))


@contextlib.contextmanager
def config_env(cfg: Config) -> Iterator[None]:
    """The configuration's modifier variables over the environment this process started with (a variable
    the user exported stays unless a modifier sets it); the kernel choices are re-resolved on entry and exit."""
    from omnilab.kernels import gemv, snake  # lazy: torch

    saved = {v: os.environ.get(v) for v in MODIFIER_VARS}
    os.environ.update(cfg.env)
    gemv.reset()
    snake.reset()
    try:
        yield
    finally:
        for v, old in saved.items():
            if old is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = old
        gemv.reset()
        snake.reset()


def _given(cfg: Config, var: str) -> str:
    """``var`` as the configuration sets it, else as the environment does, else ``auto``."""
    return settings.raw(var, cfg.env) or settings.raw(var) or "auto"


@contextlib.contextmanager
def kernel_modes(cfg: Config) -> Iterator[None]:
    """This configuration's GEMV and SnakeBeta modes for the block (``--interleave`` switches them per run;
    weight placement and storage are fixed when the configuration is built)."""
    from omnilab.kernels import use_gemv  # lazy: torch
    from omnilab.kernels.snake import use_snake  # lazy: torch

    with contextlib.ExitStack() as stack:
        stack.enter_context(use_gemv(_given(cfg, "OMNILAB_CPU_GEMV")))
        stack.enter_context(use_snake(_given(cfg, "OMNILAB_CPU_SNAKE")))
        yield


def build(cfg: Config, ckpt: Path, s: Any):
    """A ``Pipeline`` for ``cfg`` on ``ckpt`` (``s``: the ``BenchConfig``; call inside ``config_env(cfg)``)."""
    import torch

    from omnilab.pipeline import Pipeline  # lazy: torch

    max_conc, dtype = max(s.concurrency), cfg.dtype_arg(s.dtype)
    profile = getattr(s, "deploy_profile", None)  # --deploy-profile: threads, CPUs and sizes as that profile plans
    if cfg.base == "eager":
        return Pipeline.from_pretrained(ckpt, backend="eager", dtype=dtype, deploy_profile=profile,
                                        num_threads=None if profile else s.threads,
                                        max_concurrency=max_conc if profile else None)
    from omnilab.stages.vllm.deploy import VllmDeploy  # lazy: torch

    common = dict(max_model_len=s.max_model_len, block_size=128, enforce_eager=not cfg.compile_talker,
                  compile_predictor=cfg.compile_predictor, max_num_seqs=max_conc)
    explicit = s.talker_cpus is not None or s.code2wav_cpus is not None
    if (cfg.workers and not explicit) or (profile and not cfg.workers):  # what users get: the (auto) profile
        ranks = int(settings.raw("OMNILAB_TALKER_TP", cfg.env) or 1)  # +tp2: --threads is split between the ranks
        d = prepare(Path(ckpt), backend="vllm", deploy="workers" if cfg.workers else "inprocess", dtype=dtype,
                    deploy_profile=profile or "auto", num_threads=None if profile else max(s.threads // ranks, 1),
                    max_concurrency=max_conc).vllm_deploy
        # the profile's KV budget stays (the workers' environment is derived from it and must agree)
        talker = dataclasses.replace(d.talker, max_model_len=s.max_model_len, enforce_eager=not cfg.compile_talker,
                                     compile_predictor=cfg.compile_predictor)
        return Pipeline.from_pretrained(ckpt, backend="vllm", dtype=dtype, deploy_profile=profile or "auto",
                                        deploy=dataclasses.replace(d, talker=talker))
    if cfg.workers:
        cpus = sorted(os.sched_getaffinity(0))
        talker_cpus = tuple(cpus[:s.threads]) if s.talker_cpus is None else tuple(s.talker_cpus)
        c2w_cpus = (cpus[-1],) if s.code2wav_cpus is None else tuple(s.code2wav_cpus)
        deploy = VllmDeploy(VllmStageConfig(multiprocess=True, talker_cpus=talker_cpus, talker_threads=len(talker_cpus),
                                            **common),
                            code2wav="process", code2wav_cpus=c2w_cpus, code2wav_threads=len(c2w_cpus))
        return Pipeline.from_pretrained(ckpt, backend="vllm", dtype=dtype, deploy=deploy)
    torch.set_num_threads(s.threads)
    return Pipeline.from_pretrained(ckpt, backend="vllm", dtype=dtype, deploy_profile=None,
                                    deploy=VllmDeploy(VllmStageConfig(talker_threads=s.threads, **common),
                                                      code2wav="inprocess"))


def labels(pipe: Any) -> dict[str, Any]:
    """What the pipeline resolved: GEMV, SnakeBeta, weight storage, and its processes."""
    dep = pipe.deployment
    parts = decode_bytes_by_part(pipe.model.talker) or {}
    q = dep.quantization.choice if dep.quantization is not None else None
    return {"gemv": dep.gemv.label, "snake": dep.snake.label, "weights": dep.weights.label,
            "dtype_ran": str(pipe.model.dtype).replace("torch.", ""), "dtype_reason": pipe.model.dtype_reason,
            "quantization": "none" if q is None or not q.enabled else
            (f"{q.method}-g{q.group_size}" if q.group_size else q.method),
            "decode_bytes_per_frame": sum(parts.values()) if parts else None,
            "decode_bytes_talker": parts.get("talker"), "decode_bytes_predictor": parts.get("predictor"),
            "code2wav_dtype": dep.code2wav_dtype.label if dep.code2wav_dtype is not None else None,
            "code2wav_conv": dep.code2wav_conv.label if dep.code2wav_conv is not None else None,
            "deploy_profile": pipe.profile.name if pipe.profile is not None else None,
            "variant": pipe.model.config.tts_model_type,
            "processes": {str(k): v for k, v in pipe.processes().items()}}


DEFAULT_INSTRUCT = "A calm, clear voice at a moderate pace."  # VoiceDesign requests without --instruct


def reference_clip(seconds: float = 1.5, sample_rate: int = 24000) -> tuple[Any, int]:
    """The Base checkpoints' reference clip when no ``--ref-audio`` is given: ``(float32 wav, sample_rate)``, a
    180 Hz + 360 Hz tone with a little seeded noise (the same clip every run, so every row clones the same voice)."""
    import numpy as np

    t = np.arange(int(sample_rate * seconds)) / sample_rate
    noise = np.random.default_rng(0).standard_normal(t.shape)
    wav = 0.3 * np.sin(2 * np.pi * 180 * t) + 0.1 * np.sin(2 * np.pi * 360 * t) + 0.02 * noise
    return wav.astype(np.float32), sample_rate


def voice_kwargs(config: Any, s: Any) -> dict[str, Any]:
    """How bench requests choose the voice, per variant: CustomVoice a built-in speaker (``vivian`` or the first),
    VoiceDesign ``s.instruct``, Base ``s.ref_audio`` (default: :func:`reference_clip`) and ``s.ref_text``."""
    kind = config.tts_model_type
    if kind == "voice_design":
        return {"instruct": getattr(s, "instruct", None) or DEFAULT_INSTRUCT}
    if kind == "base":
        ref = getattr(s, "ref_audio", None)
        kw: dict[str, Any] = {"ref_audio": ref or reference_clip()}
        if getattr(s, "ref_text", None):
            kw["ref_text"] = s.ref_text
        return kw
    spk = config.speakers or [None]
    return {"speaker": "vivian" if "vivian" in spk else spk[0]}


def request_kwargs(pipe: Any, s: Any, index: int) -> dict[str, Any]:
    """Keyword arguments of bench request ``index`` (the voice from :func:`voice_kwargs`): greedy unless ``--sample``
    (then seeded per request)."""
    kw = {**voice_kwargs(pipe.model.config, s), "language": "english", "max_new_tokens": s.frames + 1}
    if s.sample:
        kw["seed"] = s.seed + index
    else:
        kw.update(do_sample=False, subtalker_do_sample=False)
    return kw


def measure(pipe: Any, cfg: Config, s: Any, prompts: list[str], schedule: Any, round_index: int = 0) -> dict:
    """One round of ``cfg``: a warm-up request of ``s.warmup_frames``, then every concurrency point.
    Returns ``{"config", "round", "pid", "points": [point dicts], "requests": [rows], "wait_pct"}``."""
    warm = {**request_kwargs(pipe, s, 0), "max_new_tokens": s.warmup_frames + 1}
    drv.run_point(pipe, prompts[:1], [warm], 1, schedule)
    out: dict[str, Any] = {"config": cfg.name, "round": round_index, "pid": os.getpid(), "points": [], "requests": []}
    first = schedstat_snapshot()
    for c in sorted(set(s.concurrency) | {1}):
        n = s.requests or c
        texts = [prompts[i % len(prompts)] for i in range(n)]
        a = schedstat_snapshot()
        run = drv.run_point(pipe, texts, [request_kwargs(pipe, s, i) for i in range(n)], c, schedule)
        point, reqs = drv.summarize_point(run)
        point.update(config=cfg.name, backend=cfg.name, round=round_index, cpu_wait_pct=wait_pct(a, schedstat_snapshot()))
        out["points"].append(point)
        out["requests"] += [{"config": cfg.name, "backend": cfg.name, "round": round_index, "concurrency": c, **r}
                            for r in reqs]
    out["wait_pct"] = wait_pct(first, schedstat_snapshot())
    return out


def e2e_ceiling(s1: float, c1: float, cn: float, n: int) -> float:
    """The end-to-end N-stream ratio if N rows' talker step cost one row's (weights read once, nothing else per
    row): ``N (S1 + C1) / (S1 + N C_N)``, S = talker step, C = code2wav ms per frame. code2wav is compute bound
    per stream, so its share does not shrink with N."""
    return n * (s1 + c1) / (s1 + n * cn) if s1 and c1 and cn and not math.isnan(s1 + c1 + cn) else math.nan


def derive(run: dict, floor: dict | None) -> dict[str, Any]:
    """The flat figures of one round (what the table prints, ``results.table_keys()``, and more): 1 stream's step, phases, TTFA and parts, RTF;
    the largest concurrency point's step and frames/s; ratios N / 1 (``speedup`` end to end, ``talker_speedup``
    the talker stage, ``steady_speedup`` decode steps only) and ``e2e_ceiling``; the floor measured next to it
    (``floors.measure_frame_floor``: ``step_floor_ratio`` = step / floor, and each part against its own:
    ``talker_vs_floor``, ``predictor_vs_floor``)."""
    pts = {p["concurrency"]: p for p in run["points"]}
    one, nmax = pts[1], max(pts)
    r = {"step_ms": one["decode_step_ms"], "talker_ms": one["talker_forward_ms"], "predictor_ms": one["predictor_ms"],
         "overhead_pct": one["overhead_pct"], "overhead_ms": one["overhead_ms"],
         "code2wav_ms_per_frame": one["code2wav_ms_per_frame"], "ttfa_ms": one["ttfa_ms"],
         "prefill_ms": one["prefill_step_ms"], "first_chunk_ms": one["first_chunk_ms"], "rtf": one["rtf_mean"],
         "frames_per_s": one["frames_per_s"], "playback_start_ms": one["playback_start_ms_p50"],
         "stall_ms": one["stall_ms_p50"], "wait_pct": run.get("wait_pct")}
    if nmax > 1:
        n = pts[nmax]
        ratio = lambda a, b: a / b if b and a == a and b == b else math.nan  # noqa: E731
        r.update(n_streams=nmax, n_step_ms=n["decode_step_ms"], n_frames_per_s=n["frames_per_s"],
                 n_code2wav_ms_per_frame=n["code2wav_ms_per_frame"], n_rtf=n["rtf_mean"],
                 speedup=ratio(n["frames_per_s"], one["frames_per_s"]),
                 steady_speedup=ratio(n["steady_frames_per_s"], one["steady_frames_per_s"]),
                 talker_speedup=ratio(n["talker_frames_per_s"], one["talker_frames_per_s"]),
                 e2e_ceiling=e2e_ceiling(one["decode_step_ms"], one["code2wav_ms_per_frame"],
                                         n["code2wav_ms_per_frame"], nmax))
    if floor:
        r.update(floor_ms=floor["floor_ms"], step_floor_ratio=r["step_ms"] / floor["floor_ms"],
                 talker_floor_ms=floor["talker_floor_ms"], predictor_floor_ms=floor["predictor_floor_ms"],
                 talker_vs_floor=r["talker_ms"] / floor["talker_floor_ms"],
                 predictor_vs_floor=r["predictor_ms"] / floor["predictor_floor_ms"])
    return r


def median_row(name: str, rounds: list[dict]) -> dict[str, Any]:
    """Median over rounds of every numeric figure (``runs`` = how many; ``<key>_range`` = [min, max] for the
    table's figures); other values from the first round."""
    row: dict[str, Any] = {"config": name, "runs": len(rounds)}
    for k in dict.fromkeys(k for d in rounds for k in d):
        vals = [d.get(k) for d in rounds]
        nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v]
        if nums and len(nums) == len([v for v in vals if v is not None]):
            med = statistics.median(nums)
            row[k] = int(med) if all(isinstance(v, int) for v in nums) and med == int(med) else float(med)
            if len(nums) > 1 and k in table_keys():
                row[f"{k}_range"] = [min(nums), max(nums)]
        else:
            row[k] = next((v for v in vals if v is not None), None)
    return row


def timed_build(cfg: Config, ckpt: Path, s: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    pipe = build(cfg, ckpt, s)
    return pipe, time.perf_counter() - t
