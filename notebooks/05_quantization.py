# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python (omnilab)
#     language: python
#     name: omnilab
# ---

# %% [markdown]
# # 05 · Quantization: speed against fidelity
#
# The talker's decode matrices (talker and code-predictor layers, the predictor's 15 heads, the codec head) can
# be stored as int8 (one scale per output channel) or int4 (one scale per group of 32/64/128 along K) and read by
# omnilab's quantized GEMV kernels (`docs/kernels.md`). Fewer bytes per frame make a bandwidth-bound decode
# step faster; the numbers change, and random weights cannot tell by ear whether speech survives. So this
# notebook measures both sides on the same checkpoint:
#
# * **speed**: talker + predictor ms per frame and code2wav ms per frame, the configurations run alternately
#   (interleaved rounds), so they share the host's conditions;
# * **fidelity** (`omnilab.quality.compare`, definitions in `docs/quality.md`): the reference (eager, float32,
#   unquantized) decodes greedily; each other pipeline is teacher-forced on the reference's frames and scored on
#   codebook-0 top-1 agreement and KL, the code predictor's per-codebook agreement, and code2wav's waveform SNR
#   on identical codes.
#
# `OMNILAB_TINY=1` (CI) runs the embedded tiny checkpoint; by hand, set `OMNILAB_CHECKPOINT` or leave it unset
# for a 0.6B random checkpoint (written once to the cache, ~35 s). `OMNILAB_THREADS` sets torch threads.

# %%
import os
import time

import matplotlib.pyplot as plt
import pandas as pd

import omnilab
from omnilab import display as D
from omnilab.hardware import cpu_has_native_bf16
from omnilab.quality import compare

TINY = os.environ.get("OMNILAB_TINY") == "1"
THREADS = int(os.environ.get("OMNILAB_THREADS", "0")) or None
# a random checkpoint made confident (calibrated=True): its greedy decisions have a trained model's margins, so
# an agreement below 1 counts flips a trained model would also make, not near-ties (docs/quality.md)
if os.environ.get("OMNILAB_CHECKPOINT"):
    CHECKPOINT = os.environ["OMNILAB_CHECKPOINT"]
else:
    from omnilab.checkpoint.random import cached_checkpoint
    CHECKPOINT = cached_checkpoint("tiny" if TINY else "0.6b", "custom_voice", 0, calibrated=True)
FRAMES = 12 if TINY else 40
ROUNDS = 2 if TINY else 3
TEXTS = ["The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue background."]
NATIVE_BF16, BF16_WHY = cpu_has_native_bf16()

# name -> (dtype, quantization recipe); bf16 only where the CPU computes it natively. Recipes: int8 (every part
# W8), int4 (int4 talker layers and codec head, int8 code predictor), int4-all (the predictor int4 too)
CONFIGS = {"fp32": ("float32", "none"), "int8": ("float32", "int8"), "int4": ("float32", "int4"),
           "int4-all": ("float32", "int4-all")}
if NATIVE_BF16:
    CONFIGS["bf16"] = ("bfloat16", "none")
pipes = {name: omnilab.Pipeline.from_pretrained(CHECKPOINT, backend="eager", dtype=dtype, quantization=q,
                                                num_threads=THREADS, deploy_profile=None)
         for name, (dtype, q) in CONFIGS.items()}
SPEAKER = pipes["fp32"].model.config.speakers[0]
print(f"checkpoint: {CHECKPOINT}; bf16: {BF16_WHY}")
pd.DataFrame({name: dict(p.deployment.rows()) for name, p in pipes.items()}).loc[["quantization"]].T

# %% [markdown]
# ## Speed, side by side
# Each round runs every configuration once on the same text (order rotated); the table keeps the median over
# rounds of each stage's ms per frame.

# %%
rows = []
for r in range(ROUNDS):
    order = list(pipes)[r % len(pipes):] + list(pipes)[:r % len(pipes)]
    for name in order:
        res = pipes[name].generate(TEXTS[0], speaker=SPEAKER, language="english", max_new_tokens=FRAMES + 1,
                                   do_sample=False, subtalker_do_sample=False)
        per = res.stage_ms_per_frame()
        rows.append({"config": name, "round": r, "frames": len(res.codes), **per})
speed = pd.DataFrame(rows).groupby("config").median(numeric_only=True).loc[list(pipes)]
DECODE, C2W = "talker.step", "code2wav.code2wav_chunk"  # ms per frame: the decode step, code2wav's chunks
speed[[DECODE, C2W]].round(1)

# %% [markdown]
# ## Fidelity against float32
# Teacher forcing: every pipeline sees the reference's frames, so the figures compare the same positions even
# where a free-running decode would have diverged.

# %%
ref = pipes["fp32"]
reports = {}
for name, p in pipes.items():
    t = time.perf_counter()
    reports[name] = compare(ref, p, TEXTS, max_new_tokens=FRAMES + 1, speaker=SPEAKER, language="english")
    print(f"{name}: {time.perf_counter() - t:.1f} s")
fidelity = pd.DataFrame({name: rep.summary() for name, rep in reports.items()}).T
fidelity[["c0_agreement", "c0_kl_mean", "cp_agreement", "wave_snr_db"]].astype(float).round(4)

# %%
reports["int4"]

# %% [markdown]
# ## Speed against fidelity
# Left: decode ms per frame (talker + predictor) and code2wav ms per frame. Right: codebook-0 agreement with
# the reference against the decode time: up and to the left is better.

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
decode_ms = speed[DECODE]
ax1.bar(speed.index, decode_ms, label="talker + predictor")
ax1.bar(speed.index, speed[C2W], bottom=decode_ms, label="code2wav")
ax1.axhline(80, color="k", lw=0.8, ls="--", label="real time (80 ms of audio per frame)")
ax1.set_ylabel("ms per frame")
ax1.set_title("speed (median over rounds)")
ax1.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
for name in speed.index:
    ax2.scatter(decode_ms[name], float(fidelity.loc[name, "c0_agreement"]), s=60)
    ax2.annotate(name, (decode_ms[name], float(fidelity.loc[name, "c0_agreement"])), textcoords="offset points",
                 xytext=(6, 4))
ax2.set_xlabel("talker + predictor ms per frame")
ax2.set_ylabel("codebook-0 agreement")
ax2.set_title("fidelity against speed")
fig.tight_layout()

# %% [markdown]
# ## Listen side by side
# Each pipeline's own greedy decode of the first text. Random weights make noise, not speech; with real weights
# this is where an ear judges what the numbers above say.

# %%
for name, p in pipes.items():
    res = p.generate(TEXTS[0], speaker=SPEAKER, language="english", max_new_tokens=FRAMES + 1, do_sample=False,
                     subtalker_do_sample=False)
    print(name)
    display(D.audio_player(res, normalize=False))

# %%
for p in pipes.values():
    p.close()
