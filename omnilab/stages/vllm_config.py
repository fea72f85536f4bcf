"""Configuration of the vLLM talker engine (plain data; no vLLM import).

Contract: ``VllmStageConfig`` is frozen and validated on construction: GPU-only engine options (sleep mode,
CUDA graphs, tensor/pipeline parallelism, speculative decoding, quantization, LoRA) raise
:class:`~omnilab.errors.UnsupportedError`; a KV block size that vLLM's CPU attention cannot use raises
:class:`~omnilab.errors.InputError`. ``kv_bytes_per_token`` sizes the paged KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from omnilab.errors import InputError, UnsupportedError

WORKER_CLS = "omnilab.stages.vllm_worker.TalkerCPUWorker"
_GPU_ONLY = {
    "enable_sleep_mode": "sleep mode", "gpu_memory_utilization": "gpu_memory_utilization (use "
    "kv_cache_memory_bytes)", "cudagraph_capture_sizes": "CUDA graphs", "max_cudagraph_capture_size": "CUDA graphs",
    "cuda_graph_sizes": "CUDA graphs", "tensor_parallel_size": "tensor parallelism (one worker per stage here)",
    "pipeline_parallel_size": "pipeline parallelism", "speculative_config": "speculative decoding",
    "quantization": "quantization", "kv_cache_dtype": "a quantized KV cache", "enable_lora": "LoRA",
}


@dataclass(frozen=True)
class VllmStageConfig:
    """How the talker engine runs. ``None`` fields are derived from the model and the machine.

    Attributes:
        multiprocess: spawn vLLM's engine-core and worker processes (thread binding, overlap) instead
            of running everything in this process.
        talker_threads: OpenMP threads of the talker (worker process, or this process in-process).
        talker_cpus: CPU list of the talker worker (multiprocess; ``VLLM_CPU_OMP_THREADS_BIND``).
        reserved_cpus: CPUs vLLM keeps free for its engine-core process (``VLLM_CPU_NUM_OF_RESERVED_CPU``).
        kv_cache_memory_bytes: paged KV cache size (None: room for one ``max_model_len`` request, which
            several shorter ones share; vLLM needs at least that much).
        block_size: KV block size in tokens (a multiple of 32 for vLLM's CPU attention).
        num_gpu_blocks_override: force the number of KV blocks (tests use it to force preemption).
        predictor_per_row: run the code predictor row by row (bitwise batch-invariant, slower).
        compile_predictor: torch.compile (inductor) the code predictor's layers; None = the
            ``OMNILAB_CPU_INDUCTOR`` environment variable (off by default).
        enforce_eager: False uses vLLM's torch.compile path for the talker (needs prompt embeds on).
        preload: libraries to ``LD_PRELOAD`` into the engine's processes (multiprocess), e.g. libiomp5.
        engine_core_nice: niceness of vLLM's engine-core process (multiprocess). Its main thread spin-waits
            (``sched_yield``) for up to 1 s after every worker reply, i.e. through the whole talker step, and
            would otherwise take half of a CPU from whatever shares it (code2wav, the notebook).
        engine_kwargs: extra ``vllm.EngineArgs`` (GPU-only ones are refused).
    """
    multiprocess: bool = False
    talker_threads: int | None = None
    talker_cpus: tuple[int, ...] | None = None
    reserved_cpus: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 8
    max_model_len: int = 2048
    block_size: int = 128
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None
    num_gpu_blocks_override: int | None = None
    predictor_per_row: bool = False
    compile_predictor: bool | None = None
    enforce_eager: bool = True
    preload: tuple[str, ...] = ()
    engine_core_nice: int = 10
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    log_level: str = "WARNING"

    def __post_init__(self):
        for key, what in _GPU_ONLY.items():
            if key not in self.engine_kwargs:
                continue
            value = self.engine_kwargs[key]
            if (key in ("tensor_parallel_size", "pipeline_parallel_size") and value == 1) or value in (False, None):
                continue
            raise UnsupportedError(f"{what} is not supported on CPU by omnilab's vLLM talker stage "
                                   f"(engine argument {key!r})")
        if self.block_size % 32:
            raise InputError(f"block_size must be a multiple of 32 for vLLM's CPU attention (got {self.block_size})")
        if self.talker_cpus is not None and self.talker_threads is not None and \
                len(self.talker_cpus) != self.talker_threads:
            raise InputError(f"talker_threads={self.talker_threads} but talker_cpus has {len(self.talker_cpus)} CPUs")


SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM CPU_ATTN


def padded_head_size(head_dim: int) -> int:
    """Smallest head size vLLM's CPU attention supports that holds ``head_dim`` (zero padding)."""
    for s in SUPPORTED_HEAD_SIZES:
        if s >= head_dim:
            return s
    raise InputError(f"head_dim {head_dim} is larger than vLLM's CPU attention supports")


def kv_bytes_per_token(tts_config: Any, dtype: torch.dtype) -> int:
    """Paged KV cache bytes per token of one request (all layers, keys and values)."""
    tc = tts_config.talker
    return 2 * tc.num_hidden_layers * tc.num_key_value_heads * padded_head_size(tc.head_dim) * \
        torch.empty(0, dtype=dtype).element_size()
