"""omnilab's CPU kernels (C++ compiled once per machine, loaded with ctypes).

- :func:`linear`: ``F.linear`` for the decoder stacks; 4..8 fp32 rows run omnilab's small-batch GEMV
  (weights streamed once for all rows), everything else torch. :func:`gemv_choice` says which and why;
  ``OMNILAB_CPU_GEMV=auto|omnilab|omnilab-avx512|omnilab-avx2|torch`` overrides; ``with use_gemv(mode):``
  switches it for a block (side-by-side timing on one loaded model). fp32 inputs over bf16-stored weights
  take the kernel for 1..16 rows (the bf16 expanded exactly in registers).
- :mod:`omnilab.kernels.quant` / :mod:`omnilab.kernels.qgemv`: int8 / int4 weight-only quantized decode matrices
  (quantized at load: ``from_pretrained(quantization=)``, ``OMNILAB_QUANTIZATION``); :func:`linear` dispatches a
  ``QuantizedWeight`` to ``qlinear`` (``OMNILAB_CPU_QGEMV``).
- :mod:`omnilab.kernels.norm`: the decoder's RMSNorm in one call per norm (``OMNILAB_CPU_NORM``);
  :mod:`omnilab.kernels.attention`: one token's q/k norm, RoPE, cache write and attention per layer (``OMNILAB_CPU_ATTN``);
  :mod:`omnilab.kernels.stack`: a decoder stack's one-token step in one call, and the MLP's SwiGLU (``OMNILAB_CPU_STACK``).
- :mod:`omnilab.kernels.snake`: code2wav's SnakeBeta activation fused into one pass (``OMNILAB_CPU_SNAKE``).
- :mod:`omnilab.kernels.build` / :mod:`omnilab.kernels.trust`: the compiler cache, and loading a cached library only
  when this user built it (owner, mode, the sha256 recorded at build time; docs/kernels.md#build-and-cache).

- :func:`kernel_choices`: the list of this process's kernel choices that ``pipe.deployment`` and
  ``python -m omnilab.kernels`` both show, the per-machine tuning's (:mod:`omnilab.tuning`) among them.

May import: the leaves only (``errors``, ``paths``, ``config``, ``hardware``, ``settings``), and, inside functions,
``tuning`` (:func:`kernel_choices` lists its choices; the quantized GEMV reads its prefetch distances). The lowest
compute layer: never ``models``, ``checkpoint``, ``stages``, ``profiles``, or ``display``.
"""
from dataclasses import dataclass
from typing import Any

from omnilab.kernels.attention import attention_choice
from omnilab.kernels.build import KernelBuildError, build_library, select_isa
from omnilab.kernels.gemv import MODES, GemvChoice, gemv_choice, gemv_rows, linear, use_gemv
from omnilab.kernels.norm import norm_choice
from omnilab.kernels.snake import snake_choice
from omnilab.kernels.stack import stack_choice

__all__ = ["GemvChoice", "KernelBuildError", "KernelRow", "MODES", "build_library", "gemv_choice", "gemv_rows",
           "kernel_choices", "linear", "select_isa", "use_gemv"]


@dataclass(frozen=True)
class KernelRow:
    """One kernel choice of this process: ``key`` (the ``Deployment`` field where it has one), ``title`` in words,
    and the ``choice`` (its ``label``, ``reason`` and ``source``)."""
    key: str
    title: str
    choice: Any


def kernel_choices(compute: Any) -> tuple[KernelRow, ...]:
    """This process's kernel choices for a talker computing in ``compute`` (a torch dtype), each resolved (and its
    kernel built) now: the one list ``pipe.deployment`` and ``python -m omnilab.kernels`` show, so they agree. A bad
    ``OMNILAB_CPU_*`` (or other kernel) variable raises here, before any model loads or worker starts."""
    from omnilab.tuning.code2wav_conv import conv_choice  # cycle: omnilab.tuning
    from omnilab.tuning.hugepages import hugepages_choice  # cycle: omnilab.tuning
    from omnilab.tuning.storage import weight_storage_choice  # cycle: omnilab.tuning
    from omnilab.tuning.timing import linear_paths  # cycle: omnilab.tuning

    return (KernelRow("gemv", "decode linears", gemv_choice()),
            KernelRow("weights", "decode weights", weight_storage_choice(compute)),
            KernelRow("paths", "linear paths", linear_paths()),
            KernelRow("hugepages", "decode weight pages", hugepages_choice()),
            KernelRow("norm", "decoder RMSNorm", norm_choice()),
            KernelRow("attention", "decoder one-token attention", attention_choice()),
            KernelRow("stack", "decoder stack step (all layers in one call) and SwiGLU", stack_choice()),
            KernelRow("snake", "code2wav activation", snake_choice()),
            KernelRow("code2wav_conv", "code2wav fp32 convs", conv_choice()))
