"""Storage dtype of the decode matrices of an fp32 talker: the checkpoint's bf16, expanded in registers.

Why: a decode step is bandwidth bound. It streams every talker and code-predictor matrix once per frame
(0.6B: talker 1.8 GB + 15 predictor passes 4.85 GB in fp32), so its floor is bytes / bandwidth. The
released checkpoints store these matrices in bf16, and bf16 -> fp32 is exact (the 16 bits become the
high half of the fp32 word). Keeping them in bf16 and letting omnilab's GEMV kernel expand each vector
in registers computes every product from the same fp32 values as an fp32 copy would, from half the
bytes. Measured here (2 threads, the predictor's matrices, one row): 5.9 vs 10.1 ms per pass (x1.7);
talker prefills (more than 16 rows) convert each matrix for the call and use torch's GEMM (+~15 %).

What changes numerically: the summation order of decode linears (the kernel's order instead of MKL's),
not the weights or the inputs; results agree with the fp32-copy path to fp32 rounding. Memory: the
streamed matrices take half the RAM (0.6B: 2.06 -> 1.03 GiB).

Choice (:func:`weight_storage_choice`), with a reason; ``OMNILAB_DECODE_WEIGHTS=auto|bf16|compute``:

- ``auto`` (default): bf16 storage when the compute dtype is fp32 and omnilab's GEMV kernel is in use
  (:func:`omnilab.kernels.gemv_choice`); the compute dtype otherwise;
- ``bf16``: bf16 storage, or an error if the kernel is not available;
- ``compute``: matrices cast to the compute dtype at load (the reference implementation's layout).

Only matrices the file stores in bf16 are kept in bf16 (an fp32 checkpoint is never rounded); norms,
biases and the prompt-only text projection follow the compute dtype.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from omnilab import settings
from omnilab.errors import ConfigError
from omnilab.kernels.gemv import gemv_choice

ENV = "OMNILAB_DECODE_WEIGHTS"
MODES = ("auto", "bf16", "compute")

# Talker tensors a decode step streams once per frame (released names without "talker."): decoder and
# code-predictor layer matrices, the codec head, the predictor's heads and projection. Embedding tables,
# norms and the text projection (prompt only) are not streamed.
_STREAMED = re.compile(r"^(model\.layers\.\d+\.|codec_head\.|code_predictor\.(model\.layers\.\d+\.|lm_head\.\d+\.|"
                       r"small_to_mtp_projection\.)).*weight$")


def talker_streamed_name(name: str) -> bool:
    """True for the talker matrices (names without ``talker.``) that every decode step reads."""
    return bool(_STREAMED.match(name)) and "norm" not in name


@dataclass(frozen=True)
class WeightStorage:
    """How the streamed decode matrices are stored, and why."""

    bf16: bool          # keep the file's bf16 matrices in bf16 (fp32 compute through the kernel)
    compute: str        # the compute dtype's name ("float32" / "bfloat16")
    reason: str
    source: str         # "auto" | "env"

    @property
    def label(self) -> str:
        if self.bf16:
            return "bf16 storage, fp32 compute"
        return f"{self.compute} (compute dtype)"

    def keeps_bf16(self, name: str, file_dtype: torch.dtype) -> bool:
        """Whether the talker tensor ``name`` (without ``talker.``), stored as ``file_dtype``, stays bf16."""
        return self.bf16 and file_dtype == torch.bfloat16 and talker_streamed_name(name)

    def __repr__(self) -> str:
        return f"WeightStorage({self.label!r}, source={self.source!r})"


def weight_storage_choice(compute: torch.dtype, env: str | None = None) -> WeightStorage:
    """The storage of the streamed matrices for a talker computing in ``compute``."""
    given = ((settings.raw(ENV) or "") if env is None else env).strip().lower()
    raw = given or "auto"
    if raw not in MODES:
        raise ConfigError(f"{ENV}={raw!r} is not a decode-weight storage; accepted: {', '.join(MODES)}")
    source = "env" if given else "auto"
    name = str(compute).removeprefix("torch.")
    if compute != torch.float32:
        if raw == "bf16" and compute != torch.bfloat16:
            raise ConfigError(f"{ENV}=bf16 needs a float32 or bfloat16 compute dtype, got {name}")
        return WeightStorage(False, name, f"compute dtype is {name}: matrices are stored in it", source)
    if raw == "compute":
        return WeightStorage(False, name, f"{ENV}=compute: fp32 copies of the bf16 matrices (2x the bytes per "
                                          f"decode step)", source)

    gemv = gemv_choice()
    if gemv.mode != "omnilab":
        if raw == "bf16":
            raise RuntimeError(f"{ENV}=bf16 needs omnilab's GEMV kernel (fp32 math over bf16 weights); "
                               f"{gemv.reason}")
        return WeightStorage(False, name, f"no omnilab GEMV kernel ({gemv.reason}): fp32 copies", source)
    why = ("decode matrices kept in the checkpoint's bf16 and expanded exactly to fp32 in registers by the "
           f"omnilab-{gemv.isa} kernel: the same products from half the bytes per decode step")
    return WeightStorage(True, name, f"{ENV}={raw}: {why}" if source == "env" else why, source)
