"""The compute dtype of code2wav's conv decoder: bf16 GEMMs where the CPU computes bf16 natively, fp32 otherwise.

Why: code2wav is compute bound (~5 GFLOP per 80 ms frame, ~90 % of it in the GEMMs of the four conv decoder
blocks). On a CPU with AMX or avx512_bf16, oneDNN runs those GEMMs in bf16 with fp32 accumulation much faster
than fp32 (docs/kernels.md#code2wav-bf16). Only those GEMMs change (``Code2Wav.set_compute_dtype``): the
quantizer, pre-conv, transformer and upsamplers (cheap, and the part whose rounding the decoder amplifies most),
SnakeBeta, residual sums, the streaming state and the output stay fp32.

What changes numerically: audio ~28-29 dB SNR from the fp32 decoder on the random checkpoints (bf16's 8-bit
mantissa rounds every GEMM input by up to 2^-9 relative); streaming no longer equals offline to fp32 rounding,
only to the rare bf16 rounding flips of differently blocked fp32 sums (docs/kernels.md#code2wav-bf16).

Choice (:func:`code2wav_dtype_choice`), with a reason; ``OMNILAB_CODE2WAV_DTYPE=auto|float32|bfloat16``:

- ``auto`` (default): bf16 where the CPU has native bf16 (``omnilab.hardware_info.native_bf16``: AMX or
  avx512_bf16), because it measured faster there (:data:`MEASURED`; the ISA rule with those figures, no timing
  at run time: on a shared 2-core machine a short timing swings more than the gain), unless the pipeline computes
  in fp32 (``compute=torch.float32``: e.g. ``dtype="float32"`` asked for fp32 numerics, so code2wav keeps them);
  fp32 otherwise;
- ``float32``: fp32 everywhere (the reference numerics);
- ``bfloat16``: bf16 GEMMs; on a CPU without native bf16 they are emulated (slow) and the reason says so.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from omnilab.errors import ConfigError

ENV = "OMNILAB_CODE2WAV_DTYPE"
MODES = ("auto", "float32", "bfloat16")

# The one copy of the measured figures the auto rule rests on (docs/kernels.md#code2wav-bf16 has the table).
MEASURED = ("0.6B decoder, 2 threads, Intel Xeon with AMX: 25-frame blocks 15.9 vs 24.7 ms/frame (x1.55), "
            "1-frame chunks 31.5 vs 52.2 ms/frame (x1.65), bf16 vs fp32 medians, interleaved runs")
EMULATED = "bf16 is emulated on this CPU (no avx512_bf16/AMX): expect it slower than fp32"


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


def code2wav_dtype_choice(compute=None, env: str | None = None, flags: frozenset[str] | None = None,
                          arch: str | None = None) -> Code2WavDtype:
    """The code2wav compute dtype for a pipeline whose talker computes in ``compute`` (a torch dtype; None =
    unknown, e.g. a stand-alone decoder or ``python -m omnilab.kernels``). ``env`` replaces the value of
    ``OMNILAB_CODE2WAV_DTYPE``; ``flags`` / ``arch`` replace this CPU's (tests fake hardware with them).
    Raises ``ConfigError`` naming the variable, its value and the accepted ones for an unknown mode."""
    from omnilab.hardware_info import native_bf16

    text = os.environ.get(ENV, "") if env is None else env
    raw = text.strip().lower() or "auto"
    if raw not in MODES:
        raise ConfigError(f"{ENV}={text!r} is not a code2wav dtype; accepted: {', '.join(MODES)}")
    source = "auto" if raw == "auto" else "env"
    if flags is None:
        from omnilab.hardware import cpu_flags
        flags = cpu_flags()
    native, isa = native_bf16(flags, arch or platform.machine())
    if raw == "float32":
        return Code2WavDtype("float32", native, f"{ENV}=float32: fp32 everywhere (reference numerics)", source)
    if raw == "bfloat16":
        why = f"{ENV}=bfloat16: conv decoder GEMMs in bf16, fp32 elsewhere ({isa})"
        return Code2WavDtype("bfloat16", native, why if native else f"{why}; {EMULATED}", source)
    if not native:
        return Code2WavDtype("float32", False, f"{isa}: fp32 (bf16 GEMMs would be emulated)", source)
    if compute is not None and str(compute) in ("torch.float32", "float32"):
        return Code2WavDtype("float32", True, f"{isa}, but the pipeline computes in float32: code2wav keeps fp32 "
                                              f"numerics too ({ENV}=bfloat16 forces bf16)", source)
    return Code2WavDtype("bfloat16", True, f"{isa}: conv decoder GEMMs in bf16, fp32 elsewhere, measured faster "
                                           f"({MEASURED}); audio ~28 dB SNR from fp32", source)
