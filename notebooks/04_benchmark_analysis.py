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
# # 04 · Benchmark analysis
#
# `omnilab bench` writes one `<out>/<name>.json` (default `./omnilab-bench/`): a row per configuration (the printed
# table, `rows`), its figures per configuration (`points`), and per concurrency point and per request the
# stream-latency figures (`summary`, `requests`). This notebook reads the committed ones (`data/bench`, listed with
# their machine and command in `data/README.md`): no model runs here. Method and columns: `docs/benchmarks.md`.
#
# Columns (definitions in `omnilab.instrument.trace` / `omnilab.bench.drivers`): TTFA, playback-start latency and stall;
# RTF = wall/audio and x-realtime = audio/wall; per-stage ms/frame; aggregate frames/s; peak RSS per
# process; a row's `floor_ms` = the weights a talker step reads per frame, timed as pure GEMVs on the machine next
# to the row; `step_floor_ratio` = achieved step ÷ floor (1 = at the memory-bandwidth floor).

# %%
import json

import matplotlib.pyplot as plt
import pandas as pd

from pathlib import Path

import omnilab
from omnilab import display as D
from omnilab.bench.results import load_bench

# the results committed with the repository (data/bench); `omnilab bench` writes new ones to ./omnilab-bench/
DATA_DIR = Path(omnilab.__file__).resolve().parents[1] / "data"
files = sorted((DATA_DIR / "bench").glob("*.json"))
runs = {f.stem: load_bench(f) for f in files}
list(runs)

# %%
for name, run in runs.items():
    display(run)
    for note in run.meta.get("notes", []):
        print("note:", note)

# %% [markdown]
# ## Machine and floor

# %%
def _floor_ms(r):  # one floor per row, measured next to it (none with --no-floor): their median
    fl = [row["floor_ms"] for row in r.rows if row.get("floor_ms")]
    return sorted(fl)[len(fl) // 2] if fl else float("nan")


pd.DataFrame({name: {"checkpoint": r.meta["checkpoint"].rsplit("/", 1)[-1], "dtype": r.meta["dtype"],
                     "threads": r.meta["threads"],
                     "DRAM GEMV GB/s": round(r.meta.get("bandwidth", {}).get("gbps", float("nan")), 2),
                     "GB read per frame": round(r.meta["bytes_per_frame"]["talker_bytes_per_frame"] / 1e9, 3),
                     "floor ms/frame": round(_floor_ms(r), 1),
                     "all-DRAM floor ms/frame": round(r.meta.get("floor_dram_ms_per_frame", float("nan")), 1)}
              for name, r in runs.items()})

# %% [markdown]
# ## Latency and throughput against concurrency, per backend (one row of plots per run; a backend keeps its colour)

# %%
summary = pd.concat([r.summary.assign(run=name) for name, r in runs.items()], ignore_index=True)
colors = D.backend_colors(summary["backend"])  # one colour per backend in every row below
fig, axes = plt.subplots(len(runs), 3, figsize=(13, 3.2 * len(runs)), layout="constrained", squeeze=False)
for row, (name, g) in zip(axes, summary.groupby("run")):
    for ax, y in zip(row, ("ttfa_ms_p50", "frames_per_s", "rtf_mean")):
        D.plot_bench(g, y, ax=ax, colors=colors)
        ax.set_title(f"{name}: {y}", fontsize="small")

# %% [markdown]
# ## Where a frame's time goes (ms per frame, per stage and talker phase)

# %%
phases = ["code_predictor_ms_per_frame", "talker_forward_ms_per_frame", "input_prep_ms_per_frame",
          "sampling_ms_per_frame", "code2wav_ms_per_frame"]
bars = summary[summary["backend"] != "reference"].groupby("run").size().max()  # a run may hold a whole grid
fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), max(3.5, 1.5 + 0.2 * bars)), layout="constrained",
                         squeeze=False)
for ax, (name, g) in zip(axes[0], summary[summary["backend"] != "reference"].groupby("run")):
    g.set_index(["backend", "concurrency"])[phases].plot.barh(stacked=True, ax=ax, legend=False)
    ax.axvline(80, color="tab:red", lw=0.8)  # real time: 80 ms of audio per frame
    ax.set(xlabel="ms per frame", title=name)
fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncols=len(phases), fontsize="small");

# %%
rows = pd.concat([pd.DataFrame(r.rows).assign(run=name) for name, r in runs.items()], ignore_index=True)
cols = ["run", "config", "step_ms", "ttfa_ms", "rtf", "floor_ms", "step_floor_ratio", "effective_gbps", "wait_pct"]
rows[[c for c in cols if c in rows]].round(2)

# %% [markdown]
# ## Per request

# %%
requests = pd.concat([r.requests.assign(run=name) for name, r in runs.items()], ignore_index=True)
groups = requests.groupby(["run", "backend"])
ncols = 3  # the legend goes below the axes, 3 entries per line, and the figure grows with it
fig, ax = plt.subplots(figsize=(11, 4 + 0.17 * -(-groups.ngroups // ncols)), layout="constrained")
markers = dict(zip(runs, "osD^v<>px*"))  # colour: backend (as above), marker: run
for (run, backend), g in groups:
    ax.scatter(g["ttfa_ms"], g["rtf"], label=f"{run}: {backend}", color=colors[str(backend)],
               marker=markers.get(run, "o"), s=18)
ax.set(xlabel="TTFA ms", ylabel="RTF (wall/audio)", xscale="log")
fig.legend(loc="outside lower center", ncols=ncols, fontsize="x-small", frameon=False);

# %%
print(json.dumps(runs[list(runs)[-1]].meta["machine"], indent=1))
