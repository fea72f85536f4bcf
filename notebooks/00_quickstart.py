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
# # 00 · Quickstart: synthesize, listen, look
#
# Load a Qwen3-TTS 12 Hz checkpoint, synthesize a sentence, listen to it, look at its waveform and
# spectrogram, then stream a sentence into a live player.
#
# * `OMNILAB_TINY=1` (CI) uses the embedded tiny random-weight checkpoint; otherwise set
#   `OMNILAB_CHECKPOINT` to a checkpoint directory or hub id (e.g. `Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice`).
# * `OMNILAB_THREADS` sets torch threads (default: leave as is).
# * Random weights make noise, not speech: the timings are real, the audio is not.

# %%
import os

import omnilab
from omnilab import display as D

TINY = os.environ.get("OMNILAB_TINY") == "1"
CHECKPOINT = None if TINY else os.environ.get("OMNILAB_CHECKPOINT")  # None: the embedded tiny checkpoint
THREADS = int(os.environ.get("OMNILAB_THREADS", "0")) or None
MAX_NEW_TOKENS = 30 if TINY or CHECKPOINT is None else 600  # random weights rarely stop by themselves

pipe = omnilab.Pipeline.from_pretrained(CHECKPOINT, dtype="float32", num_threads=THREADS)
SPEAKER = pipe.model.config.speakers[0] if pipe.model.config.speakers else None
pipe

# %% [markdown]
# ## One sentence
# `generate` returns a `SynthesisResult`: codes `[T, 16]`, audio at 24 kHz, and the request's `Trace`.
# In a notebook it renders as a table (TTFA, RTF = wall/audio, x-realtime = audio/wall, ms per frame
# per stage) with a player.

# %%
res = pipe.generate("The birch canoe slid on the smooth planks.", speaker=SPEAKER, language="english",
                    max_new_tokens=MAX_NEW_TOKENS, seed=0)
res

# %%
print(res)
print("codes", res.codes.shape, res.codes.dtype, "| audio", res.audio.shape, res.audio.dtype)

# %% [markdown]
# The player normalises loudness by default; `normalize=False` plays the real level (compare voices
# or checkpoints by ear without the player rescaling them).

# %%
D.audio_player(res, normalize=False)

# %%
D.plot_audio(res);

# %% [markdown]
# ## Streaming, live
# `pipe.stream(...)` yields `AudioChunk`s as soon as each chunk of frames is decoded (the deploy profile's
# chunking: a 1-frame first chunk, then larger ones). `D.live_stream` plays them as they arrive: press play at
# any time, each chunk is appended to what is playing (the marker shows the position; it waits at the end of
# what has arrived), next to a plot of delivered audio against the playback line. When the stream ends, a static
# player of the final audio appears under the panel (it still plays when the saved notebook is reopened).
# It returns the joined result; its `summary()` is a table.

# %%
live = D.live_stream(pipe, "Glue the sheet to the dark blue background.", speaker=SPEAKER, language="english",
                     max_new_tokens=MAX_NEW_TOKENS, seed=1)
live.summary()

# %%
D.plot_playback(live);

# %%
D.audio_player(live)

# %% [markdown]
# Results can be saved; the trace exports to pandas, CSV and Perfetto (see notebook 02).

# %%
import tempfile
from pathlib import Path

out = Path(tempfile.mkdtemp(prefix="omnilab-nb00-"))
print(res.save_wav(out / "quickstart.wav"))
res.trace.to_pandas().head()
