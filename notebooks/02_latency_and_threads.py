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
# # 02 · Where the CPU time goes: latency, stages, threads
#
# Every synthesis records a `Trace`: spans for admission, the talker prefill, each talker step (split into
# code predictor / input prep / talker forward / sampling), the stage hop, each code2wav chunk and each
# audio delivery, with process/thread ids and CPU time. A `ThreadUsageHook` adds per-thread and per-core
# CPU samples. Hooks go in through `from_pretrained(hooks=...)` or `pipe.hooks.add(...)`.
# `OMNILAB_TINY=1` uses the embedded tiny checkpoint (see notebook 00).

# %%
import os
import tempfile
from pathlib import Path

import omnilab
from omnilab import display as D
from omnilab.instrument.hooks import ThreadUsageHook, TimingHook

TINY = os.environ.get("OMNILAB_TINY") == "1"
CHECKPOINT = None if TINY else os.environ.get("OMNILAB_CHECKPOINT")
THREADS = int(os.environ.get("OMNILAB_THREADS", "0")) or None
MAX_NEW_TOKENS = 40 if TINY or CHECKPOINT is None else 300

# max_concurrency=2: the talker batches up to two requests per step (the auto profile sizes max_num_seqs from
# the cores and on two cores plans one; the batched timeline at the end needs two)
timing, threads = TimingHook(), ThreadUsageHook(interval_s=0.02)
pipe = omnilab.Pipeline.from_pretrained(CHECKPOINT, dtype="float32", num_threads=THREADS, max_concurrency=2,
                                        hooks=[timing, threads])
SPEAKER = pipe.model.config.speakers[0] if pipe.model.config.speakers else None
pipe.processes()  # pid -> role of every process doing this pipeline's work

# %% [markdown]
# ## One streamed request
# Metric definitions (docstrings of `omnilab.instrument.trace`): TTFA = first audio delivered − admission;
# playback-start = max over chunks of (arrival − audio already delivered); stall = playback-start − TTFA;
# RTF = wall/audio (lower is better) and x-realtime = audio/wall (higher is better).

# %%
chunks = list(pipe.stream("These days a chicken leg is a rare dish.", speaker=SPEAKER, language="english",
                          max_new_tokens=MAX_NEW_TOKENS, seed=0))
res = omnilab.SynthesisResult.from_chunks(chunks)
res.trace

# %%
res.trace.metrics().T.round(2)

# %%
D.plot_timeline(res.trace);

# %%
D.plot_step_latency(res.trace);

# %% [markdown]
# ## Threads and cores
# CPU time per thread (solid) and time runnable but waiting for a CPU (hatched: other load on the machine),
# per-core utilisation over time, and thread CPU attributed to the stage that was running.

# %%
D.plot_cpu_share(res.trace, by="thread");

# %%
D.plot_cpu_share(res.trace, by="stage");

# %%
D.plot_core_heatmap(res.trace);

# %%
res.trace.to_pandas("threads").groupby(["thread", "affinity", "omp"])[["cpu_ms", "wait_ms"]].sum()

# %% [markdown]
# ## The sampler's own cost
# The sampler times itself; compared with the talker step time it must stay far below 2 %.

# %%
ov = threads.overhead()
step_ms = sum(s.duration_ms for s in timing.spans if s.name == "step")
print(f"{ov['samples']} samples, {ov['ms_per_sample']:.2f} ms CPU each = "
      f"{100 * ov['sampler_cpu_ms'] / step_ms:.2f} % of talker step time")

# %% [markdown]
# ## Two requests batched, then the tables
# `generate([...])` batches requests in the talker, up to the profile's `max_num_seqs` (2 here, from
# `max_concurrency=2`): both requests decode in the same talker steps, so their lanes overlap in time. Each
# result has its own trace, the `TimingHook` holds all spans.

# %%
batch = pipe.generate(["Rice is often served in round bowls.", "The juice of lemons makes fine punch."],
                      speaker=SPEAKER, language="english", max_new_tokens=MAX_NEW_TOKENS // 2, seed=2)
both = batch[0].trace.merge(batch[1].trace)
steps = [[s for s in r.trace.spans if s.name == "step" and s.request_id == r.request_id] for r in batch]
first, last = [min(s.start_s for s in st) for st in steps], [max(s.end_s for s in st) for st in steps]
print("max_num_seqs", pipe.profile.values()["max_num_seqs"], "| the talker steps of the two requests overlap:",
      first[1] < last[0] and first[0] < last[1])
D.plot_timeline(both);

# %%
spans = timing.trace().to_pandas()
spans.groupby(["stage", "name"])["duration_ms"].describe()[["count", "mean", "50%", "max"]].round(2)

# %% [markdown]
# ## Export
# One row per span (`to_pandas`, CSV, Parquet with pyarrow) and a Perfetto / chrome://tracing JSON with
# one track per process and thread (open it at https://ui.perfetto.dev).

# %%
out = Path(tempfile.mkdtemp(prefix="omnilab-nb02-"))
print(res.trace.to_csv(out))
print(res.trace.to_perfetto(out / "stream.perfetto.json"))
