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
# # 01 · Step-wise talker and code2wav by hand
#
# The talker produces one frame (16 codes, 80 ms of audio) per step: a talker decode samples code 0,
# then the code predictor runs 15 times for codes 1..15. Here we advance it one frame at a time, look
# at the codes and the talker hidden state, and decode chunks ourselves through a code2wav session.
# `OMNILAB_TINY=1` uses the embedded tiny checkpoint (see notebook 00).

# %%
import os

import matplotlib.pyplot as plt
import numpy as np

import omnilab
from omnilab import display as D
from omnilab.instrument.hooks import TimingHook

TINY = os.environ.get("OMNILAB_TINY") == "1"
CHECKPOINT = None if TINY else os.environ.get("OMNILAB_CHECKPOINT")
THREADS = int(os.environ.get("OMNILAB_THREADS", "0")) or None
FRAMES = 24 if TINY or CHECKPOINT is None else 150

pipe = omnilab.Pipeline.from_pretrained(CHECKPOINT, dtype="float32", num_threads=THREADS)
SPEAKER = pipe.model.config.speakers[0] if pipe.model.config.speakers else None
timing = pipe.hooks.add(TimingHook())  # keep every span of what follows
pipe.model.config.talker

# %% [markdown]
# ## Start a request and take the first step
# `pipe.talker.start` validates and queues the request; the first `step` runs its prefill and returns
# frame 0. With `return_hidden=True` each output carries the talker hidden state that produced code 0.

# %%
rid = pipe.talker.start("It's easy to tell the depth of a well.", speaker=SPEAKER, language="english",
                        max_new_tokens=FRAMES + 1, do_sample=False, subtalker_do_sample=False)
first = pipe.talker.step(return_hidden=True)[rid]
print("frame", first.frame_index, "codes", first.codes.tolist())
print("hidden", tuple(first.hidden.shape), "| prefill %.1f ms, code predictor %.1f ms, talker %.1f ms"
      % (first.prefill_ms, first.predictor_ms, first.talker_ms))

# %% [markdown]
# ## Advance frame by frame

# %%
codes, hidden = [first.codes.numpy()], [first.hidden.float().numpy()]
while pipe.talker.has_unfinished():
    o = pipe.talker.step(return_hidden=True)[rid]
    if o.codes is not None:
        codes.append(o.codes.numpy())
        hidden.append(o.hidden.float().numpy())
codes, hidden = np.stack(codes), np.stack(hidden)  # [T, 16], [T, H]
print("finish:", o.finish_reason, "| codes", codes.shape, "| hidden", hidden.shape)

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3), layout="constrained")
im = axes[0].imshow(codes.T, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
axes[0].set(xlabel="frame", ylabel="codebook", title="codes [T, 16]")
fig.colorbar(im, ax=axes[0])
unit = hidden / np.linalg.norm(hidden, axis=1, keepdims=True)
axes[1].plot(np.linalg.norm(hidden, axis=1), label="|h|")
axes[1].plot(1 + (unit[1:] * unit[:-1]).sum(1), label="1 + cos(h_t, h_t-1)")
axes[1].set(xlabel="frame", title="talker hidden state")
axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False);

# %% [markdown]
# The request's trace (it ended with its last talker frame): per-step latency and where it went.
# `trace.check()` lists every broken trace invariant (each span inside its parent and its request, steps in
# frame order without overlap, code2wav chunks on consecutive frames); it is empty in this process and with
# worker processes alike.

# %%
step_trace = timing.traces[-1]
problems = step_trace.check()
print(step_trace.request_metrics()["frames"], "frames; trace invariants:",
      "all hold" if not problems else f"{len(problems)} broken")
for p in problems:
    print("  broken:", p)
D.plot_step_latency(step_trace);

# %% [markdown]
# ## Decode by hand, chunk by chunk
# A code2wav session keeps the decoder state between chunks, so each chunk costs the same however long
# the utterance already is. Chunked decoding equals the whole-utterance decode.

# %%
session = pipe.code2wav.open_session("by-hand")
sizes = [1, 4, 8, len(codes)]
pieces, start = [], 0
for n in sizes:
    part = codes[start:start + n]
    if len(part):
        pieces.append(session.push(part))
        start += len(part)
session.close()
chunked = np.concatenate(pieces)
full = pipe.code2wav.decode(codes)
print("chunks", [len(p) // 1920 for p in pieces], "frames; max |chunked - full| =",
      float(np.abs(chunked - full).max()), "| decode ms per chunk:", [round(x, 1) for x in session.decode_ms])

# %%
D.plot_audio((chunked, 24000));

# %%
D.audio_player((chunked, 24000))
