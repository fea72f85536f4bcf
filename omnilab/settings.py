"""Every ``OMNILAB_*`` environment variable, declared once: its kind, default, accepted values, meaning and the layer
that reads it.

``omnilab settings [--json]`` prints each with its value here and the value's source; docs/settings.md is
:func:`markdown` (a test keeps the two equal). The deploy-profile variables are :data:`PROFILE_FIELDS` (their
parsers: ``omnilab.profiles.overrides.FIELDS``), with the layer's precedence: ``OMNILAB_*`` variables > vLLM's CPU
variables > arguments > preset/file > auto. Every module reads its variables through :func:`raw` / :func:`flag`
(an undeclared name is an error; tests/test_settings.py fails on a direct read of the environment). A leaf every
layer may import: stdlib and ``omnilab.errors`` only.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Mapping

from omnilab.errors import ConfigError

KERNEL = "auto | omnilab | omnilab-avx512 | omnilab-avx2 | torch"
FLAG = "1 | true | yes | on, or 0 | false | no | off"


@dataclass(frozen=True)
class Setting:
    """One variable: ``kind`` (choice, integer, number, path, text, flag, internal), ``default`` and ``accepted`` in
    words, what it ``means``, and the ``layer`` (module) that reads it."""
    name: str
    kind: str
    default: str
    accepted: str
    means: str
    layer: str


_OWN = (
    # logging, progress, files
    Setting("OMNILAB_LOG_LEVEL", "choice", "warning", "error | warning | info | debug",
            "how loud omnilab and the libraries under it are (-v / -vv on a command)", "omnilab/logs.py"),
    Setting("OMNILAB_PROGRESS", "flag", "on a terminal or in a notebook", "0 | 1",
            "progress bars for long work (random checkpoints, loading, quantization, synthesis)",
            "omnilab/instrument/progress.py"),
    Setting("OMNILAB_CACHE", "path", "~/.cache/omnilab", "a directory",
            "where checkpoints, kernel builds and timings are cached", "omnilab/paths.py"),
    # kernels and numerics
    Setting("OMNILAB_CPU_GEMV", "choice", "auto", KERNEL, "the small-batch GEMV kernel of the decode linears",
            "omnilab/kernels/gemv.py"),
    Setting("OMNILAB_CPU_QGEMV", "choice", "auto", KERNEL, "the quantized (int8 / int4) GEMV kernel",
            "omnilab/kernels/qgemv.py"),
    Setting("OMNILAB_CPU_NORM", "choice", "auto", KERNEL, "the decoder's RMSNorm kernel", "omnilab/kernels/norm.py"),
    Setting("OMNILAB_CPU_ATTN", "choice", "auto", KERNEL, "one token's decode attention kernel",
            "omnilab/kernels/attention.py"),
    Setting("OMNILAB_CPU_STACK", "choice", "auto", KERNEL, "a decoder stack's one-token step in one call",
            "omnilab/kernels/stack.py"),
    Setting("OMNILAB_CPU_SNAKE", "choice", "auto", KERNEL, "code2wav's fused SnakeBeta activation",
            "omnilab/kernels/snake.py"),
    Setting("OMNILAB_FUSE_PROJECTIONS", "choice", "auto", "auto | off",
            "q/k/v and gate/up read in one decode call each", "omnilab/tuning/fuse.py"),
    Setting("OMNILAB_DECODE_STEP", "choice", "auto", "auto | layer | off",
            "the decode step as one call per stack, per layer, or op by op", "omnilab/models/decode_step.py"),
    Setting("OMNILAB_DECODE_WEIGHTS", "choice", "auto", "auto | bf16 | compute",
            "decode matrices kept in bf16 with fp32 compute, or fp32 copies (compute)", "omnilab/tuning/storage.py"),
    Setting("OMNILAB_HUGEPAGES", "choice", "off", "off | on | auto",
            "decode weights in one huge-page mapping", "omnilab/tuning/hugepages.py"),
    Setting("OMNILAB_PLAN_TIMING", "choice", "auto", "auto | on | refresh | off",
            "time the linear paths on this machine (cached) to choose the dtype; off: the ISA rule",
            "omnilab/tuning/timing.py"),
    Setting("OMNILAB_BF16_DECODE", "choice", "auto", "auto | kernel | torch",
            "the path of bf16 decode rows", "omnilab/tuning/timing.py"),
    Setting("OMNILAB_PREFILL_GEMM", "choice", "auto", "auto | fp32 | bf16",
            "the prefill GEMMs of fp32 compute over bf16 matrices", "omnilab/tuning/timing.py"),
    Setting("OMNILAB_CODE2WAV_DTYPE", "choice", "auto", "auto | float32 | bfloat16",
            "code2wav's compute dtype (auto: a short, cached timing on this machine)",
            "omnilab/tuning/code2wav_dtype.py"),
    Setting("OMNILAB_CODE2WAV_CONV", "choice", "auto", "auto | taps | direct",
            "code2wav's fp32 convolutions: per-tap GEMMs, oneDNN's direct convolution, or by length",
            "omnilab/tuning/code2wav_conv.py"),
    Setting("OMNILAB_QUANT_ACTIVATIONS", "choice", "auto", "auto | int8 | int16 | fp32",
            "the activations of quantized matrices", "omnilab/kernels/quant.py"),
    Setting("OMNILAB_INT4_SCALES", "choice", "rtn", "rtn | wls",
            "how int4 parts choose their scales: round to nearest, or least squares over a clipping grid (fp16 on disk)",
            "omnilab/kernels/quant.py"),
    Setting("OMNILAB_QGEMV_PREFETCH", "text", "auto", "auto, or bytes: one number or three comma-separated",
            "the quantized GEMV's software-prefetch distance (auto: timed on this machine, cached)",
            "omnilab/tuning/prefetch.py"),
    # stages and workers
    Setting("OMNILAB_API_KEY", "text", "unset (no auth)", "a key",
            "`omnilab serve`'s Bearer key on every route but /health (and the load run's key)", "omnilab/cli/serve.py"),
    Setting("OMNILAB_WORKER_TIMEOUT_S", "number", "120", "seconds > 0",
            "how long a stage worker may take to answer before it is a WorkerError", "omnilab/stages/lifecycle.py"),
    Setting("OMNILAB_OMP_RELEASE", "choice", "auto", "auto | off",
            "release a thread's GNU OpenMP pool around the calls a pipeline's owner thread computes",
            "omnilab/stages/omp_pool.py"),
    Setting("OMNILAB_CPU_INDUCTOR", "flag", "0", FLAG,
            "compile the code predictor's MLPs with inductor (vllm-omni's VLLM_OMNI_CPU_INDUCTOR must agree)",
            "omnilab/stages/vllm/config.py"),
    Setting("OMNILAB_VLLM_PREDICTOR_PER_ROW", "flag", "0", FLAG,
            "run vLLM's code predictor one decoding row at a time instead of batched", "omnilab/stages/vllm/runner.py"),
    Setting("OMNILAB_VLLM_VIEWS_KEEP", "integer", "64", "an integer >= 1",
            "how many per-checkpoint vLLM view directories are kept", "omnilab/stages/vllm/view.py"),
    # set by omnilab for its own worker processes
    Setting("OMNILAB_WORKER_PARENT", "internal", "unset", "set by omnilab",
            "identifies the client process, in the processes vLLM spawns for it", "omnilab/stages/lifecycle.py"),
    Setting("OMNILAB_SPAWN_MARKER", "internal", "unset", "set by omnilab",
            "the file a spawned worker leaves when the client script lacks its __main__ guard",
            "omnilab/stages/lifecycle.py"),
    Setting("OMNILAB_STAGE", "internal", "unset", "set by omnilab",
            "the stage a worker process runs (talker, code2wav)", "omnilab/profiles/profile.py"),
    Setting("OMNILAB_STAGE_CPUS", "internal", "unset", "set by omnilab",
            "the CPU lists a worker process was given", "omnilab/profiles/profile.py"),
    # notebooks
    Setting("OMNILAB_TINY", "flag", "0", "0 | 1", "run the notebooks on the embedded tiny checkpoint",
            "notebooks/"),
    Setting("OMNILAB_CHECKPOINT", "text", "the embedded checkpoint", "a checkpoint directory or hub id",
            "the checkpoint the notebooks load", "notebooks/"),
    Setting("OMNILAB_THREADS", "integer", "as torch has it", "an integer >= 1", "torch threads in the notebooks",
            "notebooks/"),
    Setting("OMNILAB_BATCH_BACKEND", "choice", "eager", "eager | vllm", "the backend of notebook 06's batch",
            "notebooks/06_scale_out.py"),
)

# the deploy profile's fields: field -> (environment variable, accepted values in words); the parsers live in
# omnilab/profiles/overrides.py (FIELDS)
PROFILE_FIELDS: dict[str, tuple[str, str]] = {
    "mode": ("OMNILAB_STAGE_MODE", "split | shared"),
    "talker_tp_size": ("OMNILAB_TALKER_TP", "tensor-parallel ranks for the talker, one per NUMA node"),
    "talker_threads": ("OMNILAB_TALKER_THREADS", "OpenMP threads per talker rank"),
    "talker_cpus": ("OMNILAB_TALKER_CPUS", "talker CPU list(s), '|' between ranks: '0-13|28-41'; auto | nobind"),
    "code2wav_threads": ("OMNILAB_CODE2WAV_THREADS", "code2wav OpenMP threads"),
    "code2wav_cpus": ("OMNILAB_CODE2WAV_CPUS", "code2wav CPU list: '14-15'"),
    "reserved_cpus": ("OMNILAB_RESERVED_CPUS", "CPUs kept free for the front-end: '0' or 'none'"),
    "dtype": ("OMNILAB_DTYPE", "float32 | bfloat16"),
    "quantization": ("OMNILAB_QUANTIZATION",
                     "decode matrices: none | int8 | int4 | int4-g32 | int4-g64 | int4-g128"),
    "max_num_seqs": ("OMNILAB_MAX_NUM_SEQS", "concurrent talker sequences"),
    "max_model_len": ("OMNILAB_MAX_MODEL_LEN", "talker context length (tokens)"),
    "kv_cache_bytes": ("OMNILAB_KV_CACHE_GIB", "talker KV cache budget in GiB (float)"),
    "first_chunk_frames": ("OMNILAB_FIRST_CHUNK_FRAMES", "frames in the first code2wav chunk"),
    "chunk_ramp_frames": ("OMNILAB_CHUNK_RAMP", "chunk sizes after the first: '4,8,16' or 'none'"),
    "steady_chunk_frames": ("OMNILAB_CHUNK_FRAMES", "steady-state chunk size (frames)"),
    "preload": ("OMNILAB_PRELOAD", "LD_PRELOAD for workers, ':'-separated, or 'none'"),
}

# variables that no longer set anything: setting one is an error, not a silent no-op
REMOVED_VARIABLES = {
    "OMNILAB_LEFT_CONTEXT_FRAMES": "omnilab's code2wav carries its exact decoder state from chunk to chunk, so no "
                                   "left context is recomputed (streaming equals offline)",
}


def _profile_settings() -> tuple[Setting, ...]:
    out = [Setting(var, "profile field", "auto (the planner)", text, f"the deploy profile's {field}",
                   "omnilab/profiles/overrides.py") for field, (var, text) in PROFILE_FIELDS.items()]
    out += [Setting(var, "removed", "unset", "unset", f"no longer used: {why}", "omnilab/profiles/overrides.py")
            for var, why in REMOVED_VARIABLES.items()]
    return tuple(out)


def settings() -> tuple[Setting, ...]:
    """Every declared variable, in the order docs/settings.md lists them (profile fields first)."""
    return _profile_settings() + _OWN


def declared() -> set[str]:
    return set(_names())


@lru_cache(maxsize=None)
def _names() -> frozenset[str]:
    return frozenset(s.name for s in settings())


def raw(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The value of the declared variable ``name`` in ``env`` (default ``os.environ``), None when unset: every
    module reads its ``OMNILAB_*`` variables through here, so a name missing from the registry fails at once."""
    if name not in _names():
        near = difflib.get_close_matches(name, sorted(_names()), n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise ConfigError(f"{name!r} is not a declared setting{hint}"
                          "; accepted: a name declared in omnilab/settings.py (`omnilab settings` lists them)")
    return (os.environ if env is None else env).get(name)


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def flag(name: str, env: Mapping[str, str] | None = None) -> bool | None:
    """``name`` read as a boolean: None when unset or blank, True / False for :data:`TRUE_WORDS` /
    :data:`FALSE_WORDS` (any case); another value is a ``ConfigError`` naming it and the accepted words."""
    return parse_flag(name, raw(name, env))


def parse_flag(name: str, given: str | None) -> bool | None:
    """The flag words of :func:`flag` for a value already read (``name`` only names it in the error)."""
    if given is None or not given.strip():
        return None
    v = given.strip().lower()
    if v in TRUE_WORDS:
        return True
    if v in FALSE_WORDS:
        return False
    raise ConfigError(f"{name}={given!r}: accepted values are {' / '.join(TRUE_WORDS)} and {' / '.join(FALSE_WORDS)}")


def current(env: Mapping[str, str] | None = None) -> list[dict]:
    """Each variable with ``value`` (the environment's, else its default in words) and ``source`` (env / default)."""
    env = os.environ if env is None else env
    rows = []
    for s in settings():
        given = env.get(s.name)
        rows.append({**asdict(s), "value": given if given is not None else s.default,
                     "source": "env" if given is not None else "default"})
    return rows


def markdown() -> str:
    """docs/settings.md: one table per layer."""
    head = ("# Settings\n\n"
            "Every `OMNILAB_*` environment variable, generated from `omnilab/settings.py` (`omnilab settings` prints\n"
            "each with its value here and where it comes from; `--json` for a machine). For the deploy profile's\n"
            "fields the precedence is `OMNILAB_*` variables > vLLM's CPU variables > arguments > preset/file > auto\n"
            "([profiles.md](profiles.md#override-layers)).\n")
    groups: dict[str, list[Setting]] = {}
    for s in settings():
        key = ("Deploy profile" if s.kind in ("profile field", "removed") else
               "Set by omnilab for its workers" if s.kind == "internal" else
               "Notebooks" if s.layer.startswith("notebooks") else "Library")
        groups.setdefault(key, []).append(s)
    parts = [head]
    for title in ("Deploy profile", "Library", "Notebooks", "Set by omnilab for its workers"):
        parts.append(f"\n## {title}\n\n| variable | default | accepted | meaning | read by |\n|---|---|---|---|---|\n")
        parts += [f"| `{s.name}` | {s.default} | {s.accepted.replace('|', '&#124;')} | {s.means} | `{s.layer}` |\n"
                  for s in groups.get(title, [])]
    return "".join(parts)


DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "f32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def dtype_name(value: object, where: str) -> str:
    """A compute dtype's spelling (``fp32``, ``torch.bfloat16``, ...) -> ``float32`` | ``bfloat16``; anything else
    a ``ConfigError`` naming ``where`` and the accepted ones (float16 with why it is refused on CPU)."""
    s = str(value).strip().lower().replace("torch.", "")
    if s in ("float16", "fp16", "half"):
        raise ConfigError(f"{where}={value!r}: float16 is not supported on CPU (unstable in torch CPU kernels and it "
                          f"gives NaN logits in the code predictor); use bfloat16 or float32")
    if s not in DTYPE_ALIASES:
        raise ConfigError(f"{where}={value!r}: accepted dtypes are float32 (fp32) and bfloat16 (bf16)")
    return DTYPE_ALIASES[s]


def env_dtype(env: Mapping[str, str] | None = None) -> str | None:
    """``OMNILAB_DTYPE`` as the pipeline's compute dtype, ``float32`` or ``bfloat16``; None when unset, blank or
    ``auto``. The one reading of it (the loader, code2wav's dtype and its timing, the planner's field parser), so
    they all agree on what a value means."""
    given = (raw("OMNILAB_DTYPE", env) or "").strip()
    return None if given.lower() in ("", "auto") else dtype_name(given, "OMNILAB_DTYPE")
