"""How code2wav's fp32 convolutions run: per-tap GEMMs for short inputs, oneDNN's direct convolution for long ones.

Why: a causal conv ``k`` taps wide over ``Cin`` channels can run as ``k`` BLAS GEMMs ``[Cout, Cin] x [Cin, L]`` on
shifted views of the input (``conv1d_taps``: no im2col copy, no weight reorder) or as one oneDNN convolution
(``F.conv1d``: the output tile stays in registers across all taps and channels, the weights are reordered per
call). For the few hundred samples of a streaming chunk's first decoder block the GEMMs win; for the thousands of
samples of the later blocks (160, 640, 1920 samples per frame) the direct convolution does: per-tap GEMMs with
``K = Cin = 96..384`` read and write the whole output once per tap.

Measured (2-core AMD EPYC, AVX2 + FMA, torch 2.13, 0.6B random checkpoint's decoder, steady stream, the rule
interleaved with each alternative, 6 chunks each): 25-frame chunks on 2 threads 53.4 -> 42.0 ms/frame (every conv
direct: 43.2); 10-frame chunks on 1 thread 95.7 -> 83.3 (every conv direct: 93.7); 1-frame chunks on 2 threads
119.4 -> 117.7. Audio differs from the per-tap GEMMs by at most 3.9e-6 (fp32 summation order; output RMS 0.18).

Choice (:func:`conv_choice`), ``OMNILAB_CODE2WAV_CONV``:

- ``auto`` (default): direct for a conv whose input (streaming context included) has at least :data:`MIN_SAMPLES`
  samples, per-tap GEMMs below (the measurement above: the threshold sits between the first block's 320-800
  samples of a 10-25-frame chunk, where the GEMMs were faster, and the second block's 1600+);
- ``taps``: per-tap GEMMs everywhere (the bench's ``+taps-conv``; what omnilab ran before, together with
  ``OMNILAB_CPU_GEMV=torch``, ``+torch-gemv``);
- ``direct``: oneDNN for every conv.

In every mode, a call with at most 8 outputs runs its taps through the GEMV kernel where ``OMNILAB_CPU_GEMV``
allows it (``models/conv_paths.py``). Only fp32 dense convs are concerned (pre-conv, upsamplers, conv decoder):
bf16 GEMMs (``conv1d_fused``) and the depthwise ConvNeXt conv keep their own path. Streaming still equals offline
decoding up to fp32 rounding (a chunk's length can pick a different path than the offline decode's for the same
samples).
"""
from __future__ import annotations

from dataclasses import dataclass

from omnilab import settings
from omnilab.errors import ConfigError

ENV = "OMNILAB_CODE2WAV_CONV"
MODES = ("auto", "taps", "direct")
MIN_SAMPLES = 1000
NEVER = 1 << 62  # a threshold no input reaches


@dataclass(frozen=True)
class Code2WavConv:
    """The input length from which an fp32 conv runs as oneDNN's direct convolution, and why."""

    mode: str          # "auto" | "taps" | "direct"
    min_samples: int   # direct from this many input samples; NEVER: per-tap GEMMs always
    reason: str

    @property
    def source(self) -> str:
        return "auto" if self.mode == "auto" else "env"

    @property
    def label(self) -> str:
        if self.min_samples >= NEVER:
            return "per-tap GEMMs (GEMV kernel up to 8 outputs)"
        return "oneDNN direct" if self.min_samples == 0 else f"oneDNN direct from {self.min_samples} samples, " \
                                                             f"per-tap GEMMs below (GEMV kernel up to 8 outputs)"


def conv_choice(env: str | None = None) -> Code2WavConv:
    """The fp32 conv path from ``OMNILAB_CODE2WAV_CONV`` (``env`` replaces its value); ``ConfigError`` naming the
    accepted values for anything else."""
    text = (settings.raw(ENV) or "") if env is None else env
    raw = text.strip().lower() or "auto"
    if raw not in MODES:
        raise ConfigError(f"{ENV}={text!r} is not a code2wav conv path; accepted: {', '.join(MODES)}")
    if raw == "taps":
        return Code2WavConv(raw, NEVER, f"{ENV}=taps: per-tap BLAS GEMMs for every conv")
    if raw == "direct":
        return Code2WavConv(raw, 0, f"{ENV}=direct: oneDNN's direct convolution for every conv")
    return Code2WavConv(raw, MIN_SAMPLES, f"oneDNN's direct convolution for inputs of >= {MIN_SAMPLES} samples "
                        "(the later decoder blocks), per-tap GEMMs below: measured on a 2-core AVX2 EPYC, 25-frame "
                        "chunks on 2 threads 53.4 -> 42.0 ms/frame, 10-frame on 1 thread 95.7 -> 83.3 "
                        "(docs/kernels.md#code2wav-convolutions; AVX-512 and AMX CPUs not measured); "
                        f"{ENV}=taps|direct overrides")
