"""The compute dtype of code2wav's conv decoder: bf16 GEMMs where they time faster on this CPU, fp32 otherwise.

Why: code2wav is compute bound (~5 GFLOP per 80 ms frame, ~90 % of it in the GEMMs of the four conv decoder
blocks). On a CPU with AMX, or an AMD Zen 5 core's native bf16 dot products, oneDNN runs those GEMMs in bf16
with fp32 accumulation much faster than fp32 (docs/kernels.md#code2wav-bf16). Only those GEMMs change
(``Code2Wav.set_compute_dtype``): the quantizer, pre-conv, transformer and upsamplers (cheap, and the part whose rounding the decoder amplifies most),
SnakeBeta, residual sums, the streaming state and the output stay fp32.

What changes numerically: audio ~28-29 dB SNR from the fp32 decoder on the random checkpoints (bf16's 8-bit
mantissa rounds every GEMM input by up to 2^-9 relative); streaming no longer equals offline to fp32 rounding,
only to the rare bf16 rounding flips of differently blocked fp32 sums (docs/kernels.md#code2wav-bf16).

Choice (:func:`code2wav_dtype_choice`), with a reason; ``OMNILAB_CODE2WAV_DTYPE=auto|float32|bfloat16``:

- ``auto`` (default), on a CPU with native bf16: bf16 where a short timing of the conv decoder blocks on this
  machine has bf16 at most 0.8 of fp32's time (:mod:`omnilab.tuning.code2wav_timing`, cached per CPU model,
  torch and threads; measured x1.55-1.84 on a Xeon with AMX, x2.0 on an AMD EPYC Zen 5 without AMX, x0.55 on the
  Xeon capped to avx512_bf16), else fp32. ``OMNILAB_PLAN_TIMING=off``: the ISA prior, bf16 with AMX
  (:data:`MEASURED`), fp32 with avx512_bf16 alone (:data:`MEASURED_NO_AMX`) and on aarch64 (not measured). Not bf16
  either when fp32 was asked for
  the pipeline (``dtype="float32"`` or ``OMNILAB_DTYPE=float32``: fp32 numerics, so code2wav keeps them too; an
  fp32 talker the deploy profile picked for speed does not count); fp32 otherwise;
- ``float32``: fp32 everywhere (the reference numerics);
- ``bfloat16``: bf16 GEMMs; on a CPU without native bf16 they are emulated (slow) and the reason says so.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass

from omnilab import settings
from omnilab.errors import ConfigError
from omnilab.hardware import cpu_flags

ENV = "OMNILAB_CODE2WAV_DTYPE"
MODES = ("auto", "float32", "bfloat16")

from omnilab.profiles.timing import EMULATED, MEASURED, MEASURED_NO_AMX, code2wav_dtype_rule  # noqa: F401


@dataclass(frozen=True)
class Code2WavDtype:
    """code2wav's conv decoder compute dtype, and why."""

    dtype: str       # "float32" | "bfloat16"
    native: bool     # the CPU computes bf16 natively (avx512_bf16 / AMX / aarch64 bf16)
    reason: str
    source: str      # "auto" | "env"

    @property
    def torch_dtype(self):
        import torch
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32

    @property
    def label(self) -> str:
        if self.dtype == "float32":
            return "float32"
        return "bfloat16 conv-decoder GEMMs (fp32 elsewhere)" + ("" if self.native else ", emulated")

    def __repr__(self) -> str:
        return f"Code2WavDtype({self.label!r}, source={self.source!r})"


def code2wav_dtype_choice(requested=None, env: str | None = None, flags: frozenset[str] | None = None,
                          arch: str | None = None, times=None) -> Code2WavDtype:
    """The code2wav compute dtype for a pipeline asked to compute in ``requested`` (``from_pretrained``'s
    ``dtype=``: a torch dtype or a name; None = not asked, then ``OMNILAB_DTYPE`` if set). ``env`` replaces the
    value of ``OMNILAB_CODE2WAV_DTYPE``; ``flags`` / ``arch`` replace this CPU's (tests fake hardware with them);
    ``times``: this machine's code2wav timing (None: the ISA prior); a pipeline asks
    :func:`omnilab.tuning.code2wav_timing.timed_code2wav_dtype`, which measures it where it matters.
    Raises ``ConfigError`` naming the variable, its value and the accepted ones for an unknown mode."""
    text = (settings.raw(ENV) or "") if env is None else env
    raw = text.strip().lower() or "auto"
    if raw not in MODES:
        raise ConfigError(f"{ENV}={text!r} is not a code2wav dtype; accepted: {', '.join(MODES)}")
    if flags is None:
        flags = cpu_flags()
    arch = arch or platform.machine()
    asked = (settings.env_dtype() or "") if requested is None else requested
    dtype, native, why = code2wav_dtype_rule(raw, frozenset(flags), arch, asked, times)
    return Code2WavDtype(dtype, native, why, "auto" if raw == "auto" else "env")
