"""Notebook display: matplotlib plots of traces and audio, audio players, a live streaming panel.

Contract: every ``plot_*`` takes the data plus ``ax=None`` (a new figure when None), draws, and returns
the ``Axes`` it drew on (never calls ``plt.show()``). matplotlib, IPython and ipywidgets are imported
inside the functions, so ``import omnilab.display.plots`` stays light. Inputs are ``Trace`` /
``SynthesisResult`` / numpy audio / benchmark DataFrames: the pipeline knows nothing about this module.
"""
from __future__ import annotations

import io
import wave
from typing import Any, Iterable, Sequence

import numpy as np

from omnilab.config import SAMPLE_RATE
from omnilab.instrument.export import cpu_by_stage
from omnilab.instrument.trace import PHASES, playback_start_ms

STAGE_COLORS = {"client": "tab:gray", "talker": "tab:blue", "code2wav": "tab:orange"}
SPAN_COLORS = {"admission": "tab:gray", "hop": "tab:red", "consumer": "lightgray", "step": "tab:blue",
               "prefill": "tab:purple", "code_predictor": "tab:green", "input_prep": "tab:olive",
               "talker_forward": "tab:blue", "sampling": "tab:cyan", "code2wav_chunk": "tab:orange"}
_TOP = ("admission", "step", "hop", "code2wav_chunk", "consumer")
# legends sit to the right of the axes, off the data (constrained layout makes room for them)
LEGEND_OUTSIDE = dict(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)


def _axes(ax, figsize=(9, 3)):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _audio(x: Any) -> tuple[np.ndarray, int]:
    """SynthesisResult / AudioChunk / (audio, sr) / array -> (float32 mono, sample rate)."""
    if isinstance(x, tuple) and len(x) == 2:
        return np.asarray(x[0], np.float32).reshape(-1), int(x[1])
    if hasattr(x, "audio"):
        return np.asarray(x.audio, np.float32).reshape(-1), int(getattr(x, "sample_rate", SAMPLE_RATE))
    return np.asarray(x, np.float32).reshape(-1), SAMPLE_RATE


def _trace(x: Any):
    return x.trace if hasattr(x, "trace") and not hasattr(x, "spans") else x


# ---- traces --------------------------------------------------------------------------------------
def plot_timeline(trace: Any, ax=None, phases: bool = True, max_requests: int = 8):
    """Gantt chart: one lane per (request, stage), top-level spans as bars (ms since the trace start);
    with ``phases`` the talker lane shows the step phases; deliveries are black ticks."""
    from matplotlib.patches import Patch

    trace = _trace(trace)
    t0 = trace.t0_s
    rids = trace.request_ids[:max_requests]
    ax = _axes(ax, (10, 0.9 + 0.55 * 3 * max(len(rids), 1)))
    lanes: list[str] = []
    used: set[str] = set()
    order = {"client": 0, "talker": 1, "code2wav": 2}
    for rid in rids:
        own = [s for s in trace.spans if s.request_id == rid]
        groups: dict[tuple, list] = {}
        for s in own:
            is_phase = s.stage == "talker" and s.name in PHASES
            if s.end_s <= s.start_s or (is_phase and not phases):
                continue
            if s.name in _TOP or is_phase or s.attrs.get("remote"):
                groups.setdefault((order.get(s.stage, 3), s.stage, s.pid), []).append(s)
        multi = len({k[2] for k in groups}) > 1
        first = len(lanes)
        for (_, stage, pid), spans in sorted(groups.items()):
            y = len(lanes)
            lanes.append(f"{rid} {stage}" + (f" [pid {pid}]" if multi else ""))
            for s in spans:
                outline = phases and s.name == "step"
                ax.broken_barh([(1e3 * (s.start_s - t0), s.duration_ms)], (y - 0.35, 0.7),
                               facecolors="none" if outline else SPAN_COLORS.get(s.name, STAGE_COLORS.get(s.stage, "k")),
                               edgecolors="k" if outline else "none", linewidth=0.3)
                if not outline:
                    used.add(s.name)
        for s in own:
            if s.name == "deliver" and len(lanes) > first:
                ax.plot([1e3 * (s.start_s - t0)] * 2, [first - 0.45, first + 0.45], color="k", lw=1.5)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("ms since trace start")
    ax.set_title("stage timeline")
    handles = [Patch(color=SPAN_COLORS.get(n, "k"), label=n) for n in sorted(used)]
    if handles:
        ax.legend(handles=handles, **LEGEND_OUTSIDE)
    return ax


def plot_step_latency(trace: Any, ax=None, name: str = "step", percentiles: Sequence[float] = (50, 90, 99)):
    """Per-frame latency of ``name`` spans (talker ``step`` by default) for each request, with
    percentile lines over all of them."""
    trace = _trace(trace)
    ax = _axes(ax)
    allv = []
    for rid in trace.request_ids:
        spans = sorted((s for s in trace.spans if s.request_id == rid and s.name == name), key=lambda s: s.start_s)
        v = [s.duration_ms for s in spans]
        allv += v
        ax.plot([s.frame_index for s in spans], v, marker=".", lw=0.8, label=rid)
    for q, ls in zip(percentiles, ("-", "--", ":", "-.")):
        if allv:
            p = float(np.percentile(allv, q))
            ax.axhline(p, color="k", ls=ls, lw=0.8, label=f"p{q:g} {p:.1f} ms")
    ax.axhline(80.0, color="tab:red", lw=0.8, alpha=0.6, label="real time (80 ms/frame)")
    ax.set_xlabel("frame")
    ax.set_ylabel(f"{name} ms")
    ax.set_title(f"{name} latency per frame")
    ax.legend(**LEGEND_OUTSIDE)
    return ax


def plot_core_heatmap(trace: Any, ax=None, bin_ms: float | None = None):
    """Per-core utilisation (0-1, machine-wide) over time from the sampler's core rows."""
    trace = _trace(trace)
    ax = _axes(ax)
    df = trace.to_pandas("cores")
    if not len(df):
        ax.text(0.5, 0.5, "no core samples (attach a ThreadUsageHook)", ha="center", va="center",
                transform=ax.transAxes)
        return ax
    if bin_ms:
        df = df.assign(t_ms=(df["t_ms"] // bin_ms) * bin_ms)
    m = df.pivot_table(index="core", columns="t_ms", values="busy", aggfunc="mean").fillna(0.0)
    t = m.columns.to_numpy(float)
    im = ax.imshow(m.to_numpy(), aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1,
                   extent=(t.min(), t.max() if len(t) > 1 else t.min() + 1, -0.5, len(m) - 0.5),
                   interpolation="nearest")
    ax.set_yticks(range(len(m)), [f"cpu {c}" for c in m.index])
    ax.set_xlabel("ms since trace start")
    ax.set_title("per-core utilisation (all processes)")
    ax.figure.colorbar(im, ax=ax, label="busy", fraction=0.04)
    return ax


def plot_cpu_share(trace: Any, ax=None, by: str = "thread", top: int = 12):
    """CPU time (solid) and run-queue wait (hatched) per thread (``by="thread"``) or per stage the
    sampled process was running (``by="stage"``); see ``omnilab.instrument.export.cpu_by_stage``. The
    ``top`` busiest rows are shown, the rest summed into one."""
    trace = _trace(trace)
    df = cpu_by_stage(trace)
    ax = _axes(ax, (8, 1.0 + 0.3 * min(len(df) if by == "thread" else 4, top + 1)))
    if not len(df):
        ax.text(0.5, 0.5, "no thread samples (attach a ThreadUsageHook)", ha="center", va="center",
                transform=ax.transAxes)
        return ax
    if by == "thread":
        df = df.assign(label=df["thread"].astype(str) + " (" + df["tid"].astype(str) + ", " + df["role"] + ")")
    elif by == "stage":
        df = df.assign(label=df["stage"])
    else:
        raise ValueError(f"by={by!r}; accepted: thread, stage")
    g = df.groupby("label")[["cpu_ms", "wait_ms"]].sum().sort_values("cpu_ms")
    if len(g) > top:
        rest = g.iloc[:-top].sum()
        g = g.iloc[-top:]
        g.loc[f"{len(df) - top} other rows"] = rest
        g = g.sort_values("cpu_ms")
    y = np.arange(len(g))
    total = g["cpu_ms"].sum()
    ax.barh(y, g["cpu_ms"], color="tab:blue", label="on CPU")
    ax.barh(y, g["wait_ms"], left=g["cpu_ms"], color="none", edgecolor="tab:red", hatch="//",
            label="runnable, waiting for a CPU")
    for yi, v in zip(y, g["cpu_ms"]):
        ax.text(v, yi, f" {100 * v / total:.0f}%", va="center", fontsize="small")
    ax.set_yticks(y, g.index)
    ax.set_xlabel("ms")
    ax.set_title(f"CPU time by {by}")
    ax.legend(**LEGEND_OUTSIDE)
    return ax


def plot_playback(x: Any, ax=None):
    """Streaming view of one request: audio available (ms) vs wall time (step line, one step per
    delivered chunk) and the playback line of a player that starts at the playback-start latency.
    ``x``: a request ``Trace``, a ``SynthesisResult`` with a trace, or a list of ``AudioChunk``."""
    ax = _axes(ax, (6, 3))
    if isinstance(x, (list, tuple)):
        arrival = [1e3 * c.t_ready_s for c in x]
        audio = [1e3 * len(c.audio) / c.sample_rate for c in x]
    else:
        trace = _trace(x)
        rid = trace.request_ids[0]
        t_req = min(s.start_s for s in trace.spans if s.request_id == rid)
        dl = sorted((s for s in trace.spans if s.request_id == rid and s.name == "deliver"), key=lambda s: s.start_s)
        arrival = [1e3 * (s.start_s - t_req) for s in dl]
        audio = [float(s.attrs.get("audio_ms", 0.0)) for s in dl]
    if not arrival:
        return ax

    have = np.cumsum(audio)
    ax.step([0.0] + arrival, [0.0] + list(have), where="post", label="audio delivered")
    start = playback_start_ms(arrival, audio)
    ax.plot([start, start + have[-1]], [0, have[-1]], "k--", lw=1, label=f"playback from {start:.0f} ms")
    ax.axvline(arrival[0], color="tab:green", lw=0.8, label=f"TTFA {arrival[0]:.0f} ms")
    ax.set_xlabel("wall ms since admission")
    ax.set_ylabel("audio ms")
    ax.set_title("stream: delivered audio vs playback")
    ax.legend(**LEGEND_OUTSIDE)
    return ax


# ---- audio ---------------------------------------------------------------------------------------
def plot_waveform(x: Any, ax=None):
    """Waveform of a result / chunk / array against time in seconds."""
    audio, sr = _audio(x)
    ax = _axes(ax, (9, 2))
    ax.plot(np.arange(len(audio)) / sr, audio, lw=0.5)
    ax.set_xlim(0, max(len(audio) / sr, 1e-3))
    ax.set_xlabel("time (s)")
    ax.set_ylabel("amplitude")
    ax.set_title("waveform")
    return ax


def spectrogram_db(audio: np.ndarray, n_fft: int = 1024, hop: int = 256) -> np.ndarray:
    """Log-magnitude STFT (Hann window) in dB, ``[n_fft // 2 + 1, frames]``."""
    audio = np.asarray(audio, np.float32)
    if len(audio) < n_fft:
        audio = np.pad(audio, (0, n_fft - len(audio)))
    frames = np.lib.stride_tricks.sliding_window_view(audio, n_fft)[::hop]  # [F, n_fft]
    mag = np.abs(np.fft.rfft(frames * np.hanning(n_fft).astype(np.float32), axis=-1)).T
    return 20 * np.log10(np.maximum(mag, 1e-6))


def plot_spectrogram(x: Any, ax=None, n_fft: int = 1024, hop: int = 256, dynamic_db: float = 80.0,
                     colorbar: bool = True):
    """Spectrogram (dB, ``dynamic_db`` below the peak) of a result / chunk / array, with a dB colourbar."""
    audio, sr = _audio(x)
    ax = _axes(ax, (9, 2.5))
    s = spectrogram_db(audio, n_fft, hop)
    top = float(s.max())
    im = ax.imshow(s, aspect="auto", origin="lower", cmap="magma", vmin=top - dynamic_db, vmax=top,
                   extent=(0, len(audio) / sr, 0, sr / 2000))
    ax.set_xlabel("time (s)")
    ax.set_ylabel("kHz")
    ax.set_title("spectrogram")
    if colorbar:
        ax.figure.colorbar(im, ax=ax, label="dB", fraction=0.04)
    return ax


def plot_audio(x: Any, axes=None):
    """Waveform above spectrogram; returns the two Axes."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(9, 4), sharex=True, layout="constrained")
    plot_waveform(x, axes[0])
    plot_spectrogram(x, axes[1], colorbar=False)
    axes[0].set_xlabel("")
    # one dB colourbar beside both rows, so the waveform and the spectrogram keep the same width
    axes[0].figure.colorbar(axes[1].images[0], ax=list(axes), label="dB", fraction=0.04)
    return axes


def audio_player(x: Any, normalize: bool = True, autoplay: bool = False):
    """``IPython.display.Audio`` for a result / chunk / array. ``normalize=False`` keeps the level
    (values outside [-1, 1] are clipped) so players can be compared by loudness."""
    from IPython.display import Audio

    audio, sr = _audio(x)
    if not normalize:
        audio = np.clip(audio, -1.0, 1.0)
    return Audio(audio, rate=sr, normalize=normalize, autoplay=autoplay)


def wav_bytes(audio: np.ndarray, sample_rate: int = SAMPLE_RATE, normalize: bool = True) -> bytes:
    """16-bit PCM WAV bytes of float audio (peak-normalised when ``normalize``)."""
    a = np.asarray(audio, np.float32).reshape(-1)
    peak = float(np.abs(a).max()) if len(a) else 0.0
    if normalize and peak > 0:
        a = a / peak
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes((np.clip(a, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


# ---- benchmarks -----------------------------------------------------------------------------------
def backend_colors(keys: Iterable[Any]) -> dict[str, str]:
    """A fixed colour per key (backend): the sorted distinct keys take tab10 (tab20 past ten) in order, so every
    plot given the same ``keys`` colours a backend alike whichever subset it draws."""
    names = sorted({str(k) for k in keys})
    cmap = "tab10" if len(names) <= 10 else "tab20"
    import matplotlib

    colors = matplotlib.colormaps[cmap].colors
    return {n: matplotlib.colors.to_hex(colors[i % len(colors)]) for i, n in enumerate(names)}


def plot_bench(df: Any, y: str = "ttfa_ms_p50", x: str = "concurrency", by: str = "backend", ax=None,
               colors: dict[str, str] | None = None):
    """One line per ``by`` (backend) of a benchmark summary table (``omnilab.bench.run``): ``y`` vs ``x``.
    ``colors`` maps each key to a colour (default ``backend_colors`` of this table; pass one map built over every
    table to keep a backend's colour across plots). Integer ``x`` (concurrency) gets one tick per value run."""
    ax = _axes(ax, (6, 3))
    colors = colors or backend_colors(df[by])
    for key, g in df.groupby(by):
        g = g.sort_values(x)
        ax.plot(g[x], g[y], marker="o", label=str(key), color=colors.get(str(key)))
    xs = np.unique(np.asarray(df[x], float)) if len(df) else np.zeros(0)
    if len(xs) and np.all(xs == np.round(xs)):
        ax.set_xticks(xs, [str(int(v)) for v in xs])
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(f"{y} by {x}")
    ax.legend(**LEGEND_OUTSIDE)
    return ax


def progress(iterable: Iterable | None = None, **kw):
    """``tqdm.auto.tqdm`` (widget in Jupyter, text elsewhere)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, **kw)


__all__ = ["plot_timeline", "plot_step_latency", "plot_core_heatmap", "plot_cpu_share", "plot_playback",
           "plot_waveform", "plot_spectrogram", "plot_audio", "spectrogram_db", "audio_player", "wav_bytes",
           "plot_bench", "backend_colors", "progress", "STAGE_COLORS", "SPAN_COLORS"]
