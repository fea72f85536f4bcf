"""A short timing of code2wav's conv decoder in fp32 and in bf16 on this machine, cached: what ``dtype="auto"``'s
code2wav choice rests on where the CPU computes bf16 natively (:func:`omnilab.profiles.timing.code2wav_dtype_rule`;
:func:`timed_code2wav_dtype` is what a pipeline asks).

Why a timing and not the ISA rule alone: whether oneDNN's bf16 GEMMs beat fp32 depends on the core, not only on its
flags. Measured: an Intel Xeon with AMX x1.55-1.84 faster in bf16; the same Xeon with oneDNN capped to avx512_bf16
x0.55 (slower); a 2-core AMD EPYC Zen 5 (avx512_bf16, no AMX) x2.0 faster (0.6B, 2 threads, 25-frame blocks 19.4 vs
38.9 ms/frame, a steady stream 18.0 vs 43.4), where the rule had said fp32.

:func:`code2wav_times` runs the four conv decoder blocks of the released 12 Hz decoder (the part whose GEMMs turn
bf16; random weights) on one :data:`BLOCK_FRAMES`-frame block, fp32 then bf16, alternated over :data:`ROUNDS`
rounds, best of each (the first, untimed, builds layouts and oneDNN primitives): ~2.5 s once per machine, cached
in ``$OMNILAB_CACHE/timing/code2wav-<key>.json`` (keyed like the path timing: CPU model and flags, torch, threads;
a timing taken under other load is used by this process only).
``OMNILAB_PLAN_TIMING=off`` skips it (the ISA prior), ``refresh`` measures again.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from omnilab import settings
from omnilab.hardware import cpu_has_native_bf16
from omnilab.paths import cache_dir
from omnilab.profiles.timing import asks_fp32
from omnilab.tuning.code2wav_conv import conv_choice
from omnilab.tuning.code2wav_dtype import ENV, code2wav_dtype_choice
from omnilab.tuning.timing_key import _key, _schedstat, cached, timing_mode

BLOCK_FRAMES = 10
ROUNDS = 2
# the released 12 Hz decoder's conv stages (speech_tokenizer/config.json): channels halve per block
DECODER_DIM, UPSAMPLE_RATES, INPUT_RATE = 1536, (8, 5, 4, 3), 4


def _blocks(decoder_dim: int = DECODER_DIM, rates: tuple[int, ...] = UPSAMPLE_RATES):
    """The conv decoder blocks with small random weights and zero streaming state: (blocks, state dict)."""
    from omnilab.models.code2wav_layers import (DecoderBlock, StatefulModule,  # cycle: omnilab.models
                                                set_direct_min_samples)

    dims = [decoder_dim // 2 ** i for i in range(len(rates) + 1)]
    blocks = nn.ModuleList(DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(rates)).requires_grad_(False)
    set_direct_min_samples(blocks, conv_choice().min_samples)  # fp32 runs the conv path a decoder runs (set_conv)
    gen = torch.Generator().manual_seed(0)
    for p in blocks.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.02)  # bounded activations (no inf/NaN slow paths)
    st = {}
    for name, m in blocks.named_modules():
        if isinstance(m, StatefulModule) and m.state_shape() is not None:
            m.state_key = name
            st[name] = torch.zeros(1, *m.state_shape())
    return blocks, st, dims


def _set_dtype(blocks: nn.Module, dtype: torch.dtype) -> None:
    from omnilab.models.code2wav_layers import CausalConv1d, CausalConvTranspose1d  # cycle: omnilab.models

    for m in blocks.modules():  # what Code2Wav.set_compute_dtype does to the decoder blocks
        if isinstance(m, (CausalConv1d, CausalConvTranspose1d)):
            m.conv.to(dtype)
            m.drop_derived()


@torch.no_grad()
def measure(threads: int | None = None, frames: int = BLOCK_FRAMES) -> dict[str, float]:
    """``{"float32": ms, "bfloat16": ms, "wait_share": ...}`` per frame of one ``frames`` block, now (not cached)."""
    old, start = torch.get_num_threads(), _schedstat()
    torch.set_num_threads(threads or old)
    try:
        fp32, st, dims = _blocks()
        bf16, _, _ = _blocks()
        _set_dtype(bf16, torch.bfloat16)
        x = torch.randn(1, dims[0], frames * INPUT_RATE, generator=torch.Generator().manual_seed(1))
        best = {"float32": float("inf"), "bfloat16": float("inf")}
        for r in range(ROUNDS + 1):  # round 0 builds the derived layouts and oneDNN's primitives: not counted
            for name, blocks in (("float32", fp32), ("bfloat16", bf16)):
                s = {k: v.clone() for k, v in st.items()}
                t0 = time.perf_counter()
                h = x
                for b in blocks:
                    h = b(h, s)
                if r:
                    best[name] = min(best[name], (time.perf_counter() - t0) * 1e3 / frames)
    finally:
        torch.set_num_threads(old)
    run, wait = (b - a for a, b in zip(start, _schedstat()))
    return {**best, "wait_share": wait / max(run, 1)}


_MEMO: dict[str, dict] = {}


def _decides(requested=None) -> bool:
    """Whether the timing decides code2wav's dtype here: ``OMNILAB_CODE2WAV_DTYPE`` auto, native bf16, float32 not
    asked for the pipeline (``requested``, else ``OMNILAB_DTYPE``); elsewhere the rule needs none, none is measured."""
    asked = (settings.env_dtype() or "") if requested is None else requested
    mode = (settings.raw(ENV) or "").strip().lower() or "auto"
    return mode == "auto" and not asks_fp32(asked) and cpu_has_native_bf16()[0]


def timed_code2wav_dtype(requested=None):
    """``tuning.code2wav_dtype.code2wav_dtype_choice(requested)`` with this machine's timing where it decides."""
    return code2wav_dtype_choice(requested, times=code2wav_times() if _decides(requested) else None)


def with_code2wav_times(times):
    """``times`` (a path timing, or None) with this machine's code2wav timing in ``extra["code2wav"]`` where it
    decides, so the planner's code2wav estimate follows the dtype that will run (the planner's dtype is open here)."""
    if times is None or not _decides():
        return times
    import dataclasses
    return dataclasses.replace(times, extra={**times.extra, "code2wav": code2wav_times()})


def code2wav_times(threads: int | None = None, env: str | None = None) -> dict | None:
    """The cached timing for this machine (measured on first use): ``{"float32": ms, "bfloat16": ms, "threads": n,
    "frames": block, "cached": bool}`` (ms per frame), or None under ``OMNILAB_PLAN_TIMING=off``."""
    mode = timing_mode(env)
    if mode == "off":
        return None
    threads = threads or torch.get_num_threads()
    key, parts = _key(threads, f"code2wav-conv-decoder-{conv_choice().mode}")  # fp32's time depends on the conv path
    if key in _MEMO and mode != "refresh":
        return _MEMO[key]

    def run():
        got = measure(threads)
        record = {"float32": got["float32"], "bfloat16": got["bfloat16"], "threads": threads, "frames": BLOCK_FRAMES}
        return {**record, "cached": False, "wait_share": got["wait_share"]}, record, got["wait_share"]

    times, _ = cached(cache_dir() / "timing" / f"code2wav-{key}.json", mode == "refresh",
                      lambda d: {"float32": float(d["float32"]), "bfloat16": float(d["bfloat16"]),
                                 "threads": int(d["threads"]), "frames": int(d["frames"]), "cached": True}, run, parts)
    _MEMO[key] = times
    return times
