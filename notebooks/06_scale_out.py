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
# # 06 · Scale out: batch synthesis on a Ray cluster
#
# `omnilab.batch.synthesize` (the `omnilab batch` command) takes a manifest of utterances and runs one `Pipeline`
# per Ray actor, one actor per NUMA node of each Ray node, with the actor's CPUs reserved through Ray's resources
# ([docs/batch.md](../docs/batch.md)). Here: a two-node Ray cluster started on this machine (1 CPU per node), a
# 12-row manifest, the files it writes, the throughput of each node, and a rerun that resumes.
#
# * `OMNILAB_TINY=1` (CI) and by default: the embedded tiny random-weight checkpoint (noise, not speech).
#   `OMNILAB_CHECKPOINT` picks another CustomVoice checkpoint.
# * `OMNILAB_BATCH_BACKEND`: the actors' backend (default `eager`, the fastest to start on a tiny checkpoint).
# * Last section: one stream over two tensor-parallel talker ranks (`OMNILAB_TALKER_TP=2`) against one rank.

# %%
import os
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import ray

import omnilab
from omnilab.batch import synthesize
from omnilab.batch.cluster import local_cluster

TINY = os.environ.get("OMNILAB_TINY") == "1"
CHECKPOINT = (None if TINY else os.environ.get("OMNILAB_CHECKPOINT")) or str(omnilab.default_checkpoint())
BACKEND = os.environ.get("OMNILAB_BATCH_BACKEND", "eager")
WORK = Path(tempfile.mkdtemp(prefix="omnilab-batch-"))

speakers = ["vivian", "ryan", "serena", "aiden"]
rows = [{"id": f"utt{i:02d}", "text": f"This is sentence number {i} of the batch.", "speaker": speakers[i % 4],
         "language": "english", "seed": i, "max_new_tokens": 24} for i in range(12)]
manifest = WORK / "manifest.csv"
pd.DataFrame(rows).to_csv(manifest, index=False)
pd.read_csv(manifest).head()

# %% [markdown]
# ## A two-node cluster on this machine
# `local_cluster(2, cpus_per_node=1)` starts two Ray nodes here (`ray.cluster_utils.Cluster`), each advertising one
# CPU. On a real cluster you would run `ray start --head` on one host, `ray start --address HEAD:6379` on the
# others, and pass `address="auto"` (or `ray://HEAD:10001`).

# %%
cluster = local_cluster(2, cpus_per_node=1)
ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
pd.DataFrame([{"node": n["NodeManagerAddress"] + "/" + n["NodeID"][:8], "CPU": n["Resources"].get("CPU"),
               "alive": n["Alive"]} for n in ray.nodes()])

# %% [markdown]
# ## The batch
# Each actor is sized from its node: one per NUMA node, `num_cpus` = the node's physical cores capped by the Ray
# node's CPU resource (1 here), and its Pipeline planned with that many threads. Results stream back to the driver,
# which writes `wav/<id>.wav` (renamed into place, never partial) and `metrics.parquet`.

# %%
report = synthesize(manifest, CHECKPOINT, WORK / "out", address=cluster.address, backend=BACKEND, dtype="float32",
                    progress=False, log=print)
print(report)
pd.DataFrame(report.actors)[["actor", "node", "pid", "threads", "profile", "load_s"]]

# %%
metrics = report.metrics
metrics[["id", "node", "actor", "frames", "audio_s", "ttfa_ms", "rtf", "seed"]]

# %% [markdown]
# ## Throughput per node
# Utterances and seconds of audio each node produced per second of the run (from the actors being ready to the last
# row). With one CPU per node the two nodes share this machine's two cores, so their sum is what the machine gives.

# %%
per_node = metrics.groupby("node").agg(utterances=("id", "count"), audio_s=("audio_s", "sum"),
                                       busy_s=("wall_s", "sum"), mean_rtf=("rtf", "mean"))
per_node["utterances_per_s"] = per_node["utterances"] / report.synth_s
per_node["audio_s_per_s"] = per_node["audio_s"] / report.synth_s
per_node.round(3)

# %%
fig, ax = plt.subplots(1, 2, figsize=(9, 3))
short = [n.split("/")[-1] for n in per_node.index]
ax[0].bar(short, per_node["utterances_per_s"], color="tab:blue")
ax[0].set(title="utterances / s", xlabel="Ray node")
ax[1].bar(short, per_node["audio_s_per_s"], color="tab:green")
ax[1].set(title="audio seconds / s", xlabel="Ray node")
fig.suptitle(f"{len(metrics)} utterances on {len(per_node)} nodes: {report.utterances_per_s:.2f} utt/s in all")
fig.tight_layout()

# %%
import soundfile as sf
from IPython.display import Audio

wav, sr = sf.read(WORK / "out" / "wav" / "utt00.wav", dtype="float32")
Audio(wav, rate=sr)

# %% [markdown]
# ## Resume
# A rerun skips every id whose wav exists: delete two outputs and only those two are synthesized again.

# %%
for rid in ("utt03", "utt07"):
    (WORK / "out" / "wav" / f"{rid}.wav").unlink()
again = synthesize(manifest, CHECKPOINT, WORK / "out", address=cluster.address, backend=BACKEND, dtype="float32",
                   progress=False, log=print)
print("redone:", tuple(sorted(again.done)), "| skipped:", len(again.skipped))

# %%
ray.shutdown()
cluster.shutdown()

# %% [markdown]
# ## One stream over two ranks: a tensor-parallel talker
# The other way to use more than one node's worth of hardware: `OMNILAB_TALKER_TP=2` (or `talker_tp_size: 2` in a
# deploy YAML) runs the talker as two vLLM worker processes, each holding half of every decoder layer's attention
# heads and MLP width, their partial sums added by vLLM's all-reduce after every attention and MLP; the code
# predictor runs whole on each rank ([docs/vllm-seam.md](../docs/vllm-seam.md#tensor-parallel-talker)). It is meant
# for a two-socket server, one rank per NUMA node; this machine has one node, so the planner cuts the ranks from
# its cores and warns that no gain is to be expected (shown below). The comparison: the same greedy request with one
# rank (the eager backend, whose greedy codes the one-rank vLLM talker equals) and with two ranks.

# %%
import time
import warnings

import numpy as np

from omnilab import Pipeline

TEXT = "One stream over two tensor-parallel ranks."
GREEDY = dict(speaker="vivian", language="english", do_sample=False, subtalker_do_sample=False, max_new_tokens=24)
runs = {}
with Pipeline.from_pretrained(CHECKPOINT, backend="eager", dtype="float32") as one:
    one.generate(TEXT, **GREEDY)  # warm-up
    t0 = time.perf_counter()
    runs["1 rank (eager)"] = (one.generate(TEXT, **GREEDY), time.perf_counter() - t0)
os.environ["OMNILAB_TALKER_TP"] = "2"
try:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        two = Pipeline.from_pretrained(CHECKPOINT, backend="vllm", dtype="float32")
    with two:
        print("warning:", *[str(w.message) for w in caught if "tensor parallelism" in str(w.message)])
        print("talker_tp_size:", two.profile.talker_tp_size.value, "|", two.profile.talker_tp_size.reason)
        print("processes:", two.processes())
        two.generate(TEXT, **GREEDY)  # warm-up
        t0 = time.perf_counter()
        runs["2 ranks (vLLM workers)"] = (two.generate(TEXT, **GREEDY), time.perf_counter() - t0)
finally:
    del os.environ["OMNILAB_TALKER_TP"]

# %%
(a, _), (b, _) = runs.values()
n = min(len(a.codes), len(b.codes))
same = next((k for k in range(n) if not np.array_equal(a.codes[k], b.codes[k])), n)
print(f"frames equal before the first difference: {same} of {n} (a difference, if any, is a near-tie of fp32 "
      f"rounding: the ranks add the same partial sums in another order)")
pd.DataFrame([{"run": name, "frames": r.num_frames, "wall_s": round(wall, 3), "rtf": round(r.rtf, 2),
               "talker ms/frame": round(sum(v for k, v in r.stage_ms_per_frame().items()
                                            if k.startswith("talker.")), 1)}
              for name, (r, wall) in runs.items()])

