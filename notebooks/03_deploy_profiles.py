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
# # 03 · Deploy profiles: what this machine can do, and what it did
#
# `probe_hardware()` reads the CPU topology, ISA, cgroup limits and memory; `plan(hardware, checkpoint)`
# sizes threads and cores per stage, dtype, KV cache and code2wav chunking, each value with a reason.
# Here we plan, run with the plan, and compare the plan's estimate with the measured trace.
# `OMNILAB_TINY=1` uses the embedded tiny checkpoint (see notebook 00).

# %%
import os

import omnilab
from omnilab import display as D
from omnilab.profiles import StageTimes, list_presets, resolve_profile

TINY = os.environ.get("OMNILAB_TINY") == "1"
CHECKPOINT = None if TINY else os.environ.get("OMNILAB_CHECKPOINT")
ckpt = CHECKPOINT or omnilab.default_checkpoint()
MAX_NEW_TOKENS = 30 if TINY or CHECKPOINT is None else 300

hw = omnilab.probe_hardware()
hw

# %%
profile = omnilab.plan(hw, ckpt)
profile

# %%
print(profile.estimate.describe())
profile.to_env("talker")

# %% [markdown]
# Named presets, and the same profile as vllm-omni-style deploy YAML:

# %%
print(list_presets())
resolve_profile("vm-2core")

# %%
print(profile.to_yaml())

# %% [markdown]
# ## Run with the plan
# `Pipeline.from_pretrained(deploy_profile=...)` applies a profile (the default is `"auto"`: this plan):
# the vLLM backend's talker threads, CPU binding, KV cache and `max_num_seqs`, the dtype and the chunking.
# Where the profile splits the CPUs between the stages they run in worker processes, otherwise the engine
# runs in this process (`deploy="workers"` forces workers). `pipe.deployment` says what was decided and
# why. In this process the stages take turns on the same threads, so the plan is fitted to that placement
# first (an automatic code2wav thread count becomes the talker's, with the reason): `pipe.profile` is what was
# applied. `pipe.check_profile()` checks each stage where it really runs (a worker: its CPU affinity, threads
# and OpenMP threads read back from `/proc`; this process: the torch threads its calls run with) against
# `pipe.profile`, and raises `WorkerError` naming every difference; the table puts the three side by side.

# %%
import pandas as pd

v = profile.values()
pipe = omnilab.Pipeline.from_pretrained(CHECKPOINT, deploy_profile=profile)
print("placement:", pipe.deployment.placement, "|", pipe.deployment.reason)
readback = pipe.check_profile()  # raises WorkerError on any difference from pipe.profile
roles = {role: pid for pid, role in pipe.processes().items()}
pd.DataFrame({stage: {"planned threads": profile.threads(stage), "planned CPUs": profile.cpus(stage),
                      "applied threads": pipe.profile.threads(stage), "applied CPUs": pipe.profile.cpus(stage),
                      "runs in": f"worker pid {roles[stage]}" if stage in roles else "this process",
                      "read back": getattr(readback[stage], "num_threads", readback[stage]),
                      "read-back CPUs": getattr(readback[stage], "cpus", "not pinned (this process)")}
              for stage in ("talker", "code2wav")}).T

# %%
SPEAKER = pipe.model.config.speakers[0] if pipe.model.config.speakers else None
chunks = list(pipe.stream("Four hours of steady work faced us.", speaker=SPEAKER, language="english",
                          max_new_tokens=MAX_NEW_TOKENS, seed=0))
measured = omnilab.SynthesisResult.from_chunks(chunks)
m = measured.trace.request_metrics()
print({k: round(m[k], 1) for k in ("ttfa_ms", "stall_ms", "rtf", "talker_ms_per_frame", "code2wav_ms_per_frame")})

# %% [markdown]
# ## Plan again with the measured stage times
# The estimate was derived from bytes and FLOPs per frame; feeding the measured per-frame times back
# (`StageTimes`) gives a plan whose estimate matches this machine.

# %%
times = StageTimes(talker_ms_per_frame=max(m["talker_ms_per_frame"], 1e-3),
                   code2wav_ms_per_frame=max(m["code2wav_ms_per_frame"], 1e-3),
                   talker_threads=profile.threads("talker"), code2wav_threads=profile.threads("code2wav"),
                   code2wav_chunk_frames=v["steady_chunk_frames"])
measured_profile = omnilab.plan(hw, ckpt, stage_times=times)
print("before:", profile.estimate.describe())
print("after: ", measured_profile.estimate.describe())
measured_profile

# %%
D.plot_playback(measured);
