"""Configuration of the vLLM talker engine (plain data; no vLLM import).

Contract: ``VllmStageConfig`` is frozen and validated on construction: GPU-only engine options (sleep mode,
CUDA graphs, tensor/pipeline parallelism, speculative decoding, quantization, LoRA) raise
:class:`~omnilab.errors.UnsupportedError`; a KV block size that vLLM's CPU attention cannot use raises
:class:`~omnilab.errors.InputError`. ``gpu_memory_utilization`` is accepted with vLLM CPU's meaning (the
worker takes that fraction of its NUMA node's memory and gives the KV cache what it does not use; an explicit
``kv_cache_memory_bytes`` wins, as in vLLM). ``kv_bytes_per_token`` sizes the paged KV cache with the
planner's formula (``omnilab.profiles.cost``: head size padded to ``SUPPORTED_HEAD_SIZES``, ``BLOCK_SIZE`` blocks
plus vLLM's reserve block); ``block_size`` defaults to ``BLOCK_SIZE``.

What the engine is built with comes from two pure functions, ``engine_kwargs`` (``EngineArgs`` keywords) and
``engine_env`` (the environment its processes start with: ``VllmStageConfig.env``, a deploy profile's
``to_env("talker")``, plus the CPU variables below, which must agree with it); tests compare both with the
profile's ``engine_args`` / ``to_env`` without starting an engine.

vLLM's CPU variables in this process's environment reach the engine as vLLM reads them, never unset:
``engine_kv_bytes`` / ``engine_cpu_env`` return the ``kv_cache_memory_bytes`` and the environment for the
engine's processes, and raise ``ConfigError`` where the config and a variable disagree (a profile planned
in this environment already agrees): ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) is the KV budget vLLM applies;
``VLLM_CPU_OMP_THREADS_BIND`` lists must equal ``talker_cpus``, ``auto`` gives way to the config's list,
``all`` (vLLM < 0.10) reaches vLLM as ``nobind``; ``VLLM_CPU_NUM_OF_RESERVED_CPU`` must equal
``reserved_cpus``. ``compile_predictor_flag`` resolves the code-predictor compile flag: the argument, else
``OMNILAB_CPU_INDUCTOR``, else vllm-omni's ``VLLM_OMNI_CPU_INDUCTOR`` (both set: they must agree), else off.
Plain Python: no vLLM or torch import.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from omnilab import settings
from omnilab.errors import ConfigError, InputError, UnsupportedError
from omnilab.hardware import GiB, format_cpulist
from omnilab.profiles import cost
from omnilab.profiles.cost import BLOCK_SIZE
from omnilab.profiles.cost import padded_head_size  # noqa: F401 (stages/vllm/model.py imports it from here)
from omnilab.profiles.overrides import NOBIND, parse_bind, reserve_count, whole_gib
from omnilab.stages._env import env_flag

WORKER_CLS = "omnilab.stages.vllm.worker.TalkerCPUWorker"
_GPU_ONLY = {
    "enable_sleep_mode": "sleep mode", "cudagraph_capture_sizes": "CUDA graphs",
    "max_cudagraph_capture_size": "CUDA graphs",
    "cuda_graph_sizes": "CUDA graphs", "pipeline_parallel_size": "pipeline parallelism",
    "speculative_config": "speculative decoding",
    "quantization": "quantization", "kv_cache_dtype": "a quantized KV cache", "enable_lora": "LoRA",
}


@dataclass(frozen=True)
class VllmStageConfig:
    """How the talker engine runs. ``None`` fields are derived from the model and the machine.

    Attributes:
        multiprocess: spawn vLLM's engine-core and worker processes (thread binding, overlap) instead
            of running everything in this process.
        talker_threads: OpenMP threads of the talker (worker process, or this process in-process).
        talker_cpus: CPU list of the talker worker (multiprocess; ``VLLM_CPU_OMP_THREADS_BIND``); with
            ``tensor_parallel_size > 1`` one CPU list per rank (a tuple of tuples; None: this process's CPUs cut
            into equal contiguous lists).
        tensor_parallel_size: talker ranks (vLLM worker processes, multiprocess only), each holding a slice of the
            decoder's matrices (:mod:`omnilab.stages.vllm.tensor_parallel`); ``engine_kwargs`` may give it too.
        pin_threads: False runs the talker worker's OpenMP threads unpinned (``VLLM_CPU_OMP_THREADS_BIND=nobind``,
            ``OMP_NUM_THREADS=talker_threads``); ``talker_cpus`` must then be None.
        reserved_cpus: CPUs vLLM keeps free for its engine-core process (``VLLM_CPU_NUM_OF_RESERVED_CPU``).
        kv_cache_memory_bytes: paged KV cache size (None: room for one ``max_model_len`` request, which
            several shorter ones share; vLLM needs at least that much).
        block_size: KV block size in tokens (a multiple of 32 for vLLM's CPU attention); default
            ``omnilab.profiles.cost.BLOCK_SIZE``, the size the planner budgets with.
        num_gpu_blocks_override: force the number of KV blocks (tests use it to force preemption).
        predictor_per_row: run the code predictor row by row (bitwise batch-invariant, slower).
        compile_predictor: torch.compile (inductor) the code predictor's layers; None = the
            ``OMNILAB_CPU_INDUCTOR`` or ``VLLM_OMNI_CPU_INDUCTOR`` environment variable (off by default).
        enforce_eager: False uses vLLM's torch.compile path for the talker (needs prompt embeds on).
        preload: libraries to ``LD_PRELOAD`` into the engine's processes (multiprocess), e.g. libiomp5.
        engine_core_nice: niceness of vLLM's engine-core process (multiprocess). Its main thread spin-waits
            (``sched_yield``) for up to 1 s after every worker reply, i.e. through the whole talker step, and
            would otherwise take half of a CPU from whatever shares it (code2wav, the notebook).
        engine_kwargs: extra ``vllm.EngineArgs`` (GPU-only ones are refused; ``gpu_memory_utilization`` is a
            fraction of the worker's NUMA node memory, used when no KV size is given).
        env: environment the engine's processes start with (multiprocess only): a deploy profile's
            ``to_env("talker")`` (``VllmDeploy.from_profile``). The values this config implies for the same
            variables (CPU binding, ``LD_PRELOAD``, the KV size) must agree with it (``ConfigError``).
        log_level: vLLM's log level (``ERROR`` ... ``DEBUG``); None = what ``omnilab.logs.verbosity()`` gives
            (ERROR by default, WARNING at ``info``). A ``VLLM_LOGGING_LEVEL`` the user set wins.
    """
    multiprocess: bool = False
    talker_threads: int | None = None
    talker_cpus: tuple[int, ...] | tuple[tuple[int, ...], ...] | None = None
    tensor_parallel_size: int = 1
    pin_threads: bool = True
    reserved_cpus: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 8
    max_model_len: int = 2048
    block_size: int = BLOCK_SIZE
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None
    num_gpu_blocks_override: int | None = None
    predictor_per_row: bool = False
    compile_predictor: bool | None = None
    enforce_eager: bool = True
    preload: tuple[str, ...] = ()
    engine_core_nice: int = 10
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    log_level: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        for key, what in _GPU_ONLY.items():
            if key not in self.engine_kwargs:
                continue
            value = self.engine_kwargs[key]
            if (key == "pipeline_parallel_size" and value == 1) or value in (False, None):
                continue
            raise UnsupportedError(f"{what} is not supported on CPU by omnilab's vLLM talker stage "
                                   f"(engine argument {key!r})")
        frac = self.engine_kwargs.get("gpu_memory_utilization")
        if frac is not None and (isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1):
            raise InputError(f"gpu_memory_utilization={frac!r}: expected a fraction in (0, 1] of the worker's NUMA "
                             f"node memory (vLLM's CPU meaning)")
        if not self.pin_threads and self.talker_cpus is not None:
            raise InputError(f"pin_threads=False (nobind) takes no talker_cpus, got {self.talker_cpus}")
        if self.env and not self.multiprocess:
            raise InputError(f"env sets the environment of the engine's processes; it needs multiprocess=True "
                             f"(got {sorted(self.env)})")
        if self.block_size % 32:
            raise InputError(f"block_size must be a multiple of 32 for vLLM's CPU attention (got {self.block_size})")
        self._check_tensor_parallel()
        for cpus in self.rank_cpus or ():
            if self.talker_threads is not None and len(cpus) != self.talker_threads:
                raise InputError(f"talker_threads={self.talker_threads} but talker CPU list {format_cpulist(cpus)!r} "
                                 f"has {len(cpus)} CPUs (one thread per listed CPU, per rank)")

    def _check_tensor_parallel(self) -> None:
        given = self.engine_kwargs.get("tensor_parallel_size")
        if given is not None:
            if isinstance(given, bool) or not isinstance(given, int) or given < 1:
                raise InputError(f"engine_kwargs tensor_parallel_size={given!r}: expected a positive integer")
            if self.tensor_parallel_size not in (1, given):
                raise InputError(f"tensor_parallel_size={self.tensor_parallel_size} but engine_kwargs gives "
                                 f"{given}; give it once")
            object.__setattr__(self, "tensor_parallel_size", given)
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise InputError(f"tensor_parallel_size={tp!r}: expected a positive integer")
        if tp > 1 and not self.multiprocess:
            raise InputError(f"a {tp}-rank tensor-parallel talker runs one vLLM worker process per rank: it needs "
                             f"multiprocess=True (Pipeline deploy='workers')")
        cpus = self.talker_cpus
        nested = bool(cpus) and all(isinstance(r, (tuple, list)) for r in cpus)
        if cpus is not None and (tp > 1) != nested:
            raise InputError(f"talker_cpus {cpus!r}: expected one CPU list per rank (a tuple of {tp} tuples) for "
                             f"tensor_parallel_size={tp}" if tp > 1 else
                             f"talker_cpus {cpus!r}: expected one CPU list (tuple of ints) for one rank")
        if nested and len(cpus) != tp:
            raise InputError(f"talker_cpus has {len(cpus)} rank list(s) but tensor_parallel_size is {tp}")

    @property
    def rank_cpus(self) -> tuple[tuple[int, ...], ...] | None:
        """The talker's CPU list per rank (None: not pinned to given CPUs)."""
        if self.talker_cpus is None:
            return None
        if self.tensor_parallel_size > 1:
            return tuple(tuple(r) for r in self.talker_cpus)
        return (tuple(self.talker_cpus),)


def kv_bytes_per_token(tts_config: Any, dtype: Any) -> int:
    """Paged KV cache bytes per token of one request (all layers, keys and values): the planner's formula,
    :func:`omnilab.profiles.cost.kv_bytes_per_token` (head size padded), for a ``torch.dtype``."""
    tc = tts_config.talker
    return cost.kv_bytes_per_token(tc.num_hidden_layers, tc.num_key_value_heads, tc.head_dim, dtype.itemsize)


# ---------------------------------------------------------------- vLLM's CPU variables and the engine
_flag = env_flag  # the one boolean parser of omnilab's variables (stages/_env.py)


def compile_predictor_flag(value: bool | None, environ: Mapping[str, str]) -> tuple[bool, str]:
    """``(compile, source)``: ``value`` if given, else ``OMNILAB_CPU_INDUCTOR``, else ``VLLM_OMNI_CPU_INDUCTOR``
    (vllm-omni's name; both set: they must agree), else off."""
    if value is not None:
        return bool(value), "argument compile_predictor"
    ours, theirs = _flag(environ, "OMNILAB_CPU_INDUCTOR"), _flag(environ, "VLLM_OMNI_CPU_INDUCTOR")
    if ours is not None and theirs is not None and ours != theirs:
        raise ConfigError(f"OMNILAB_CPU_INDUCTOR={settings.raw('OMNILAB_CPU_INDUCTOR', environ)!r} and "
                          f"VLLM_OMNI_CPU_INDUCTOR={environ['VLLM_OMNI_CPU_INDUCTOR']!r} disagree; unset one")
    if ours is not None:
        return ours, "env OMNILAB_CPU_INDUCTOR"
    if theirs is not None:
        return theirs, "env (vLLM-Omni) VLLM_OMNI_CPU_INDUCTOR"
    return False, "default: off"


def _set_var(environ: Mapping[str, str], var: str) -> str | None:
    raw = environ.get(var)
    return raw if raw is not None and raw.strip() != "" else None  # vLLM ignores an empty value here


def engine_kv_bytes(c: VllmStageConfig, derived: int, environ: Mapping[str, str]) -> int | None:
    """``kv_cache_memory_bytes`` for the engine: ``VLLM_CPU_KVCACHE_SPACE`` when set (vLLM applies it over the
    argument; a different explicit ``c.kv_cache_memory_bytes`` is a ``ConfigError``), else the config's, else
    None when ``gpu_memory_utilization`` is given (vLLM sizes the cache), else ``derived``."""
    raw = _set_var(environ, "VLLM_CPU_KVCACHE_SPACE")
    if raw is not None:
        kv = whole_gib(raw, "VLLM_CPU_KVCACHE_SPACE")
        if c.kv_cache_memory_bytes is not None and c.kv_cache_memory_bytes != kv:
            raise ConfigError(f"the talker engine is configured with kv_cache_memory_bytes={c.kv_cache_memory_bytes} "
                              f"({c.kv_cache_memory_bytes / GiB:.2f} GiB) but VLLM_CPU_KVCACHE_SPACE={raw!r} is set, "
                              f"which vLLM applies instead; unset it, or plan the profile in this environment")
        return kv
    if c.kv_cache_memory_bytes is not None:
        return c.kv_cache_memory_bytes
    return None if c.engine_kwargs.get("gpu_memory_utilization") is not None else derived


def engine_cpu_env(c: VllmStageConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` / ``OMP_NUM_THREADS`` / ``VLLM_CPU_NUM_OF_RESERVED_CPU`` for the engine's
    processes (multiprocess), consistent with the environment (see the module docstring)."""
    env: dict[str, str] = {}
    raw = _set_var(environ, "VLLM_CPU_OMP_THREADS_BIND")
    theirs = parse_bind(raw, "VLLM_CPU_OMP_THREADS_BIND") if raw is not None else None
    ours = NOBIND if not c.pin_threads else c.rank_cpus
    if ours is None and c.pin_threads and c.tensor_parallel_size > 1 and theirs in (None, "auto"):
        ours = split_ranks(sorted(os.sched_getaffinity(0)), c.tensor_parallel_size, c.talker_threads)
    same = theirs in (None, "auto", ours) or (isinstance(theirs, tuple) and isinstance(ours, tuple) and
                                               len(theirs) == len(ours) and
                                               all(set(a) == set(b) for a, b in zip(theirs, ours)))
    if isinstance(theirs, tuple) and len(theirs) != c.tensor_parallel_size:
        raise ConfigError(f"VLLM_CPU_OMP_THREADS_BIND={raw!r} gives {len(theirs)} rank list(s) but the talker runs "
                          f"{c.tensor_parallel_size} tensor-parallel rank(s)")
    if ours is not None and not same:
        mine = "nobind" if ours == NOBIND else "|".join(map(format_cpulist, ours))
        raise ConfigError(f"the talker engine is configured to bind {mine!r} but VLLM_CPU_OMP_THREADS_BIND={raw!r} is "
                          f"set, which vLLM would apply; unset it, or plan the profile in this environment")
    bind = ours if ours is not None else theirs
    if bind == NOBIND:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # what vLLM >= 0.10 calls 'all' (it rejects 'all')
        if c.talker_threads is not None:
            env["OMP_NUM_THREADS"] = str(c.talker_threads)  # under nobind vLLM leaves OpenMP to the environment
    elif ours is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(format_cpulist, ours))  # '|' between ranks
    elif raw is None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"  # vLLM's default, stated (otherwise the environment's value stays)
    count = _set_var(environ, "VLLM_CPU_NUM_OF_RESERVED_CPU")
    n = reserve_count(count, "VLLM_CPU_NUM_OF_RESERVED_CPU") if count is not None else None
    if c.reserved_cpus is not None:
        if n is not None and n != c.reserved_cpus:
            raise ConfigError(f"reserved_cpus={c.reserved_cpus} but VLLM_CPU_NUM_OF_RESERVED_CPU={count!r} is set; "
                              f"unset one")
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(c.reserved_cpus)
    return env


def split_ranks(cpus: list[int], tp: int, threads: int | None = None) -> tuple[tuple[int, ...], ...]:
    """``cpus`` cut into ``tp`` contiguous lists of ``threads`` CPUs each (None: as many as fit); fewer CPUs than
    ranks is an InputError (each rank needs a CPU of its own)."""
    per = threads or len(cpus) // tp
    if per < 1 or per * tp > len(cpus):
        raise InputError(f"a {tp}-rank tensor-parallel talker with {threads or 1} thread(s) per rank needs "
                         f"{tp * (threads or 1)} CPUs; this process may use {len(cpus)} ({format_cpulist(cpus)})")
    return tuple(tuple(cpus[i * per:(i + 1) * per]) for i in range(tp))


# ---------------------------------------------------------------- what the engine is built with (pure)
# The directory holding the ``omnilab`` package (``omnilab/stages/vllm/config.py`` -> four levels up), put on
# the engine processes' PYTHONPATH so that they import this omnilab.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _agree(env: Mapping[str, str], var: str, value: str, what: str) -> None:
    if var in env and env[var] != value:
        raise ConfigError(f"the talker's process environment sets {var}={env[var]!r} (the deploy profile's "
                          f"to_env('talker')) but {what} gives {value!r}; build the config from one profile")


def engine_env(c: VllmStageConfig, environ: Mapping[str, str], *,
               compile_predictor: bool) -> dict[str, str | None]:
    """Variables to set (str) or unset (None) while the engine is built; in multiprocess mode its processes
    start with them. Multiprocess: ``c.env`` (a profile's ``to_env("talker")``, every key as given), the CPU
    variables of :func:`engine_cpu_env` (checked against ``environ`` and against ``c.env``), ``LD_PRELOAD``,
    ``SPT_NOENV`` and ``PYTHONPATH``. In-process: only omnilab's and vLLM's switches (nothing that binds
    this process)."""
    env: dict[str, str | None] = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if c.multiprocess else "0",
        # the argument, or the variable set to a true word (a word that is neither: ConfigError)
        "OMNILAB_VLLM_PREDICTOR_PER_ROW": "1" if c.predictor_per_row or _flag(
            environ, "OMNILAB_VLLM_PREDICTOR_PER_ROW") else None,
        "OMNILAB_CPU_INDUCTOR": "1" if compile_predictor else "0",  # what the runner reads
        "VLLM_USE_V2_MODEL_RUNNER": None,
    }
    if not c.multiprocess:
        return env
    cpu = engine_cpu_env(c, environ)
    if c.preload:
        cpu["LD_PRELOAD"] = ":".join(c.preload)
    for var, value in cpu.items():
        _agree(c.env, var, value, "the engine config")
    env.update(c.env)
    env.update(cpu)
    if not environ.get("SPT_NOENV"):
        # vLLM names its processes with setproctitle, which otherwise writes over the start of the environment
        # block the kernel shows as /proc/<pid>/environ; this keeps the start environment readable (readback)
        env["SPT_NOENV"] = "1"
    pp = environ.get("PYTHONPATH", "")
    if PACKAGE_PARENT not in pp.split(os.pathsep):
        env["PYTHONPATH"] = PACKAGE_PARENT + (os.pathsep + pp if pp else "")
    return env


def engine_kwargs(c: VllmStageConfig, environ: Mapping[str, str], *, model_dir: str, dtype: str,
                  per_token_bytes: int) -> dict[str, Any]:
    """``vllm.EngineArgs`` keywords for the talker engine. The KV size is :func:`engine_kv_bytes` with, when no
    size is configured, room for one ``max_model_len`` request (``cost.kv_cache_bytes_for``, the planner's
    rule); a ``VLLM_CPU_KVCACHE_SPACE`` in ``c.env`` must give the same size."""
    derived = cost.kv_cache_bytes_for(per_token_bytes, 1, c.max_model_len, c.block_size)
    kv = engine_kv_bytes(c, derived, environ)
    if c.multiprocess and _set_var(c.env, "VLLM_CPU_KVCACHE_SPACE") is not None:
        theirs = engine_kv_bytes(c, derived, c.env)  # what vLLM applies in the engine's processes
        if theirs != kv:
            _agree(c.env, "VLLM_CPU_KVCACHE_SPACE", f"{kv} B", "the engine's KV size")
    kwargs: dict[str, Any] = dict(
        model=model_dir, skip_tokenizer_init=True, dtype=dtype, max_model_len=c.max_model_len,
        enforce_eager=c.enforce_eager, enable_prompt_embeds=not c.enforce_eager, enable_prefix_caching=False,
        worker_cls=WORKER_CLS, load_format="omnilab", kv_cache_memory_bytes=None if kv is None else int(kv),
        max_num_seqs=c.max_num_seqs, block_size=c.block_size, enable_chunked_prefill=c.enable_chunked_prefill,
        generation_config="vllm", hf_overrides={}, seed=0, disable_log_stats=True,
        tensor_parallel_size=c.tensor_parallel_size)
    if c.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = c.max_num_batched_tokens
    if c.num_gpu_blocks_override is not None:
        kwargs["num_gpu_blocks_override"] = c.num_gpu_blocks_override
    kwargs.update(c.engine_kwargs)
    return kwargs
