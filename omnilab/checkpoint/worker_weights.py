"""Reading stage weights in worker processes without holding the checkpoint file in memory.

Contract: ``load_talker_weights(checkpoint, cfg, dtype)`` (the vLLM talker worker) and
``load_code2wav_weights(checkpoint, speech)`` (the code2wav worker) load their part of a checkpoint directory
through the same strict loader as the client (:func:`omnilab.checkpoint.load.load_talker_from` /
``load_code2wav_from`` over :func:`~omnilab.checkpoint.load.load_strict`: names, shapes, dtype policy, huge-page
arena, 64-byte aligned tensors), so a worker's state dict equals the client's; only the reading differs:
``mmap=False``, one tensor at a time with plain ``readinto``, so the file's pages are never part of the
worker's resident set. ``release_memory`` returns freed heap pages to the OS. No vLLM import.
"""
from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

from torch import nn

from omnilab.checkpoint.load import load_code2wav_from, load_talker_from
from omnilab.checkpoint.tensor_index import TensorIndex, weight_files
from omnilab.errors import CheckpointError


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``): weights dropped
    from a process otherwise stay resident in the allocator's free lists."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _index(directory: Path, what: str):
    files = weight_files(directory, "model")
    if not files:
        raise CheckpointError(f"{directory}: no {what}")
    return TensorIndex(files)


def load_talker_weights(checkpoint: str | os.PathLike, cfg: Any, dtype: Any, quantization: Any = None) -> nn.Module:
    """The omnilab ``Talker`` (``cfg``: the checkpoint's ``Qwen3TTSConfig``) from ``model.safetensors``, as
    ``load_model`` loads it (dtype policy of :func:`omnilab.checkpoint.load.load_talker_from`, ``quantization``:
    the client's ``omnilab.kernels.quant.Quantization``, quantized at load the same way), without mmap."""
    return load_talker_from(_index(Path(checkpoint), "model.safetensors"), cfg, dtype, mmap=False,
                            quantization=quantization)


def load_code2wav_weights(checkpoint: str | os.PathLike, speech: Any) -> nn.Module:
    """The fp32 ``Code2Wav`` (``speech``: the checkpoint's ``SpeechTokenizerConfig``) from
    ``speech_tokenizer/model.safetensors``, as ``load_model`` loads it, without mmap."""
    return load_code2wav_from(_index(Path(checkpoint) / "speech_tokenizer", "speech_tokenizer/model.safetensors"),
                              speech, mmap=False)
