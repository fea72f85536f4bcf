"""Reading stage weights in worker processes without holding the checkpoint file in memory.

Contract: ``load_prefixed(factory, files, prefix, dtype)`` builds a module with meta parameters and fills
it from safetensors files one tensor at a time with plain ``readinto`` (no mmap, so the file's pages are
never part of the worker's resident set; strict names and shapes, ``CheckpointError`` otherwise).
``load_talker_weights`` keeps bf16 embedding tables in bf16 behind an exact fp32 upcast.
``release_memory`` returns freed heap pages to the OS. No vLLM import.
"""
from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn


class _UpcastEmbedding(nn.Embedding):
    """An embedding table stored in a narrower dtype whose looked-up rows are cast to ``out_dtype``.
    bf16 -> fp32 is exact, so the rows equal those of an fp32 copy of the table, at half the memory."""
    out_dtype: torch.dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).to(self.out_dtype)


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``): weights dropped
    from a process otherwise stay resident in the allocator's free lists."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_prefixed(factory: Callable[[], nn.Module], files, prefix: str, dtype: torch.dtype,
                  keep_bf16: Callable[[str], bool] | None = None,
                  streamed: Callable[[str], bool] | None = None) -> nn.Module:
    """Build ``factory()`` with meta parameters and fill it from the ``prefix``-ed tensors of ``files``
    (strict names and shapes; ``CheckpointError`` otherwise), one tensor at a time with plain file reads.
    Floating tensors are cast to ``dtype``, except those ``keep_bf16(name)`` selects when stored as bf16;
    the matrices ``streamed`` selects go to one huge-page arena (``module.weight_arena``)."""
    from omnilab.errors import CheckpointError
    from omnilab.checkpoint.load import meta_init
    from omnilab.checkpoint.tensor_index import TensorIndex

    index = TensorIndex(list(files))
    with meta_init():
        module = factory()
    expected = {k: tuple(t.shape) for k, t in module.state_dict().items()}
    present = {k[len(prefix):] for k in index.where if k.startswith(prefix)}
    if present != set(expected):
        missing, extra = sorted(set(expected) - present), sorted(present - set(expected))
        raise CheckpointError(f"{files[0]}: {prefix}* tensors do not match the config (missing {missing[:5]}, "
                              f"unexpected {extra[:5]})")
    from omnilab.kernels.hugepages import plan_arena

    for k, shape in expected.items():
        if index.shape(prefix + k) != shape:
            raise CheckpointError(f"{index.where[prefix + k][0]}: {prefix}{k} has shape {index.shape(prefix + k)}, "
                                  f"config says {shape}")
    stored = {}
    for k in expected:
        file_dtype = index.dtype(prefix + k)
        keep = keep_bf16 is not None and file_dtype == torch.bfloat16 and keep_bf16(k)
        stored[k] = file_dtype if keep or not file_dtype.is_floating_point else dtype
    arena, in_arena = plan_arena({k: (shape, stored[k]) for k, shape in expected.items()}, streamed)
    state = {}
    for k in expected:
        t = index.read(prefix + k)  # plain file reads into a fresh tensor: no mapping of the file
        # arena tensors: cast while copying in (no fp32 temporary)
        state[k] = arena.put(t, stored[k]) if k in in_arena else (t if t.dtype == stored[k] else t.to(stored[k]))
    module.load_state_dict(state, strict=True, assign=True)
    module.weight_arena = arena
    return module.requires_grad_(False).eval()


def load_talker_weights(checkpoint: str | os.PathLike, cfg: Any, dtype: torch.dtype) -> nn.Module:
    """The omnilab ``Talker`` from ``model.safetensors``. Embedding tables (text, codec, the predictor's 15
    codebooks) stay in their file dtype when that is bf16 and ``dtype`` is fp32 (exact upcast of each
    looked-up row): 0.75 GB less for the released 0.6B geometry. The decode matrices are stored as
    :func:`omnilab.kernels.storage.weight_storage_choice` says (``talker.weight_storage``)."""
    from omnilab.errors import CheckpointError
    from omnilab.checkpoint.load import weight_files
    from omnilab.models.talker import Talker

    files = weight_files(Path(checkpoint), "model")
    if not files:
        raise CheckpointError(f"{checkpoint}: no model.safetensors")
    tables = ["model.text_embedding.weight", "model.codec_embedding.weight"] + [
        f"code_predictor.model.codec_embedding.{q}.weight" for q in range(cfg.talker.num_code_groups - 1)]
    from omnilab.kernels.storage import weight_storage_choice
    from omnilab.checkpoint.load import streamed_selector

    storage = weight_storage_choice(dtype)
    tables = frozenset(tables) if dtype == torch.float32 else frozenset()
    talker = load_prefixed(lambda: Talker(cfg), files, "talker.", dtype, streamed=streamed_selector(),
                           keep_bf16=lambda k: k in tables or storage.keeps_bf16(k, torch.bfloat16))
    talker.weight_storage = storage
    for emb in talker.modules():
        if isinstance(emb, nn.Embedding) and emb.weight.dtype != dtype:
            emb.__class__ = _UpcastEmbedding
            emb.out_dtype = dtype
    return talker.requires_grad_(False).eval()
