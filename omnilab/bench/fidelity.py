"""The fidelity columns of ``omnilab bench``: each row's numerics against eager float32 unquantized.

Speed rows differ in backend, kernels and placement, which do not change greedy results (tests hold vLLM == eager
and kernel choices to equal codes), and in numerics: the compute dtype and the decode matrices' quantization. So
fidelity is measured once per distinct ``(dtype, quantization)`` a row ran with, on eager pipelines, with
:func:`omnilab.quality.compare` (teacher-forced against the reference's greedy frames: first-codebook top-1
agreement and KL, per-codebook agreement of the code predictor, code2wav's waveform SNR on identical codes), over
the first ``FIDELITY_TEXTS`` prompts at the bench's frame count: 8 x 33 = 264 frames at ``--frames 32``, so the
first-codebook agreement's 95 % interval (``c0_agreement_ci95``, pooled frames) is about +-3 points near 0.91 (two
texts left it 15 points wide; docs/quality.md#how-many-frames-an-agreement-needs).
The reference side runs once (:func:`omnilab.quality.reference`) for every setting compared. Where the bench made its
own random checkpoint, fidelity is measured on its confident twin (``calibrated=True``, ``run.fidelity_checkpoint``):
decisions with a trained model's margins, so a flip is an error rather than a near-tie (docs/quality.md#confident-
random-checkpoints). The reference is
eager, float32, unquantized, with a float32 code2wav (``OMNILAB_CODE2WAV_DTYPE=float32``); a test pipeline gets the
environment the rows ran under.

``--fidelity auto`` measures when some row's numerics differ from the reference's, ``on`` always, ``off`` never.
Each row gets ``fidelity``: ``{c0_agreement, c0_kl_mean, cp_agreement, wave_snr_db, c0_agreement_ci95, texts, frames,
seconds}``; ``meta["fidelity_bf16"]`` holds bf16 compute's (unquantized) figures, measured whenever fidelity is, so a
quantized row is read beside the rounding of bf16 alone; ``meta["fidelity_checkpoint"]`` where they were measured.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

FIDELITY_TEXTS = 8                      # prompts compared per numerics setting
REFERENCE = ("float32", "none")         # (dtype, quantization) of the reference pipeline
BF16 = ("bfloat16", "none")             # always measured beside the rows: the yardstick a quantization is read against
FIELDS = ("c0_agreement", "c0_kl_mean", "cp_agreement", "wave_snr_db")


def _key(row: dict) -> tuple[str, str] | None:
    d, q = row.get("dtype_ran"), row.get("quantization")
    return (str(d), str(q)) if d and q else None


def _build(ckpt: Path, dtype: str, quantization: str, threads: int, extra_env: dict[str, str]):
    from omnilab.bench.backends import Config, config_env  # lazy: numpy
    from omnilab.pipeline import Pipeline  # lazy: torch

    with config_env(Config("fidelity", "eager", env={"OMNILAB_QUANTIZATION": quantization, **extra_env})):
        return Pipeline.from_pretrained(ckpt, backend="eager", dtype=dtype, num_threads=threads, deploy_profile=None)


def add_fidelity(cfg: Any, ckpt: Path, prompts: list[str], rows: list[dict], meta: dict) -> None:
    """Put ``fidelity`` on every row whose numerics were measured (see the module docstring); notes in ``meta``."""
    keys = {k for k in map(_key, rows) if k is not None}
    if cfg.fidelity == "off" or not keys or (cfg.fidelity == "auto" and keys <= {REFERENCE}):
        if cfg.fidelity == "auto" and keys:
            meta["notes"].append("fidelity: every row ran the reference numerics (float32, unquantized): not measured")
        return
    from omnilab.bench.backends import request_kwargs  # lazy: numpy
    from omnilab.bench.modes import log  # lazy: numpy
    from omnilab.quality import compare, reference  # lazy: torch

    texts = prompts[:FIDELITY_TEXTS]
    log(f"[bench] fidelity: {len(keys)} numerics setting(s) against eager float32 unquantized, {len(texts)} texts")
    ref = _build(ckpt, *REFERENCE, cfg.threads, {"OMNILAB_CODE2WAV_DTYPE": "float32"})
    results: dict[tuple[str, str], dict] = {}
    try:
        voice = ("speaker", "language", "instruct", "ref_audio", "ref_text")  # the variant's voice (voice_kwargs)
        kw = {k: v for k, v in request_kwargs(ref, cfg, 0).items() if k in voice}
        run = reference(ref, texts, max_new_tokens=cfg.frames + 1, **kw)
        for key in sorted(keys | {BF16}):
            t = time.perf_counter()
            try:
                test = _build(ckpt, *key, cfg.threads, {})
            except Exception as e:  # reported, the speed rows stand
                meta["notes"].append(f"fidelity {key}: could not build: {type(e).__name__}: {str(e)[:300]}")
                continue
            try:
                rep = compare(run, test)
            finally:
                test.close()
            summary = rep.summary()
            results[key] = {**{f: summary.get(f) for f in FIELDS}, "texts": len(texts), "frames": summary["frames"],
                            "c0_agreement_ci95": list(summary["c0_agreement_ci95"]),
                            "seconds": time.perf_counter() - t}
            log(f"[bench] fidelity {key[0]} {key[1]}: " + ", ".join(
                f"{f} {results[key][f]:.4g}" for f in FIELDS if isinstance(results[key][f], float)))
    finally:
        ref.close()
    meta["fidelity_checkpoint"] = str(ckpt)
    meta["fidelity_bf16"] = results.get(BF16)  # bf16 compute's row, whether or not a speed row ran it
    for r in rows:
        if _key(r) in results:
            r["fidelity"] = results[_key(r)]
            r.update({f"fidelity_{f}": results[_key(r)][f] for f in FIELDS})
