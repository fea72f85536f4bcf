"""Display functions on the Agg backend return artists; players, HTML reprs, the live panel."""
from __future__ import annotations

import base64
import io
import wave
from html.parser import HTMLParser

import numpy as np
import pytest

from _deps import need  # noqa: E402

matplotlib = need("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from omnilab import display as D  # noqa: E402
from omnilab.instrument.hooks import ThreadUsageHook  # noqa: E402
from omnilab.results import SynthesisResult  # noqa: E402

KW = dict(speaker="vivian", language="english", max_new_tokens=8, do_sample=False, subtalker_do_sample=False)


@pytest.fixture(scope="module")
def streamed(tiny_pipe):
    with tiny_pipe.hooks.using(ThreadUsageHook(interval_s=0.02)):
        chunks = list(tiny_pipe.stream("Plots need data.", chunk_schedule=None, **KW))
    return chunks, SynthesisResult.from_chunks(chunks, text="Plots need data.")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("fn", [D.plot_timeline, D.plot_step_latency, D.plot_core_heatmap, D.plot_cpu_share,
                                D.plot_playback, D.plot_waveform, D.plot_spectrogram])
def test_plots_return_axes_with_content(streamed, fn):
    _, res = streamed
    ax = fn(res)
    assert isinstance(ax, Axes) and ax.has_data()
    _, given = plt.subplots()
    assert fn(res, ax=given) is given  # draws where told


def test_timeline_has_one_lane_per_stage_and_legend(streamed):
    ax = D.plot_timeline(streamed[1].trace)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert any(lbl.endswith("talker") for lbl in labels) and any(lbl.endswith("code2wav") for lbl in labels)
    assert ax.get_legend() is not None


def test_cpu_share_by_stage_and_bad_argument(streamed):
    ax = D.plot_cpu_share(streamed[1], by="stage")
    assert {t.get_text() for t in ax.get_yticklabels()} & {"talker", "code2wav", "idle", "client"}
    with pytest.raises(ValueError, match="accepted"):
        D.plot_cpu_share(streamed[1], by="core")


@pytest.mark.parametrize("fn, what", [(D.plot_core_heatmap, "core"), (D.plot_cpu_share, "thread")])
def test_plots_without_samples_say_so(fn, what):
    """A trace without thread samples draws no data (an empty heatmap would read as an idle machine), only a
    message that names the missing samples and the hook that records them."""
    from omnilab.instrument.trace import Trace

    ax = fn(Trace())
    assert [t.get_text() for t in ax.texts] == [f"no {what} samples (attach a ThreadUsageHook)"]
    assert not (ax.lines or ax.collections or ax.images or ax.patches)


def test_plot_audio_and_playback_from_chunks(streamed):
    chunks, res = streamed
    axes = D.plot_audio(res)
    assert len(axes) == 2 and all(isinstance(a, Axes) for a in axes)
    assert D.plot_playback(chunks).has_data()


def test_spectrogram_shape_and_wav_bytes():
    sr = 24000
    tone = np.sin(2 * np.pi * 1000 * np.arange(sr) / sr).astype(np.float32)
    s = D.spectrogram_db(tone, n_fft=512, hop=128)
    assert s.shape[0] == 257
    assert abs(int(np.argmax(s.mean(axis=1))) - round(1000 / (sr / 512))) <= 1  # the peak sits at 1 kHz
    with wave.open(io.BytesIO(D.wav_bytes(0.1 * tone)), "rb") as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (sr, 1, sr)
        pcm = np.frombuffer(w.readframes(sr), "<i2")
    assert pcm.max() > 30000  # normalised to full scale


def test_audio_player_normalisation(streamed):
    need("IPython")
    _, res = streamed
    a = D.audio_player(res)
    b = D.audio_player(res, normalize=False)
    assert "<audio" in a._repr_html_() and a.data[:4] == b"RIFF" and a.data != b.data


class _Cells(HTMLParser):
    """The ``<th>``/``<td>`` texts of a page and the ``src`` of its ``<audio>``/``<source>`` elements."""

    def __init__(self):
        super().__init__()
        self.rows, self.srcs, self._cell = [], [], None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("th", "td"):
            self._cell = ""
        elif tag in ("audio", "source") and dict(attrs).get("src"):
            self.srcs.append(dict(attrs)["src"])

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag in ("th", "td") and self._cell is not None:
            self.rows[-1].append(self._cell.strip())
            self._cell = None


def test_html_reprs(streamed):
    """The result's notebook view: one table row per summary figure (its value as shown) and a player whose WAV is
    the result's audio, sample for sample; the trace's view: one row per request with its TTFA."""
    from omnilab.html_tables import fmt

    _, res = streamed
    page = _Cells()
    page.feed(res._repr_html_())
    assert page.rows == [[str(k), fmt(v)] for k, v in res.summary().items()]
    [src] = page.srcs
    assert src.startswith("data:audio/wav;base64,")
    with wave.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])), "rb") as w:
        assert (w.getframerate(), w.getnframes()) == (res.sample_rate, len(res.audio))
    trace = _Cells()
    trace.feed(res.trace._repr_html_())
    summary = [[str(k), fmt(v)] for k, v in res.trace.summary().items()]
    assert trace.rows[:len(summary)] == summary  # the trace's figures, then its per-request table
    header = trace.rows[len(summary)]
    [row] = [r for r in trace.rows[len(summary) + 1:] if res.request_id in r]
    assert float(row[header.index("ttfa_ms")]) == pytest.approx(res.ttfa_ms, abs=0.01)
    assert "Trace(" in repr(res.trace)


def _inside(ax, legend) -> bool:
    """Whether the legend's box overlaps the axes' data area (in display pixels)."""
    ax.figure.canvas.draw()
    a, b = ax.get_window_extent(), legend.get_window_extent()
    return b.x0 < a.x1 - 1 and b.x1 > a.x0 + 1 and b.y0 < a.y1 - 1 and b.y1 > a.y0 + 1


@pytest.mark.parametrize("fn", [D.plot_timeline, D.plot_step_latency, D.plot_cpu_share, D.plot_playback])
def test_legends_sit_off_the_data(streamed, fn):
    ax = fn(streamed[1])
    assert ax.get_legend() is not None and not _inside(ax, ax.get_legend())


def test_waveform_and_spectrogram_say_their_units(streamed):
    _, res = streamed
    ax = D.plot_waveform(res)
    assert ax.get_ylabel() == "amplitude" and "s" in ax.get_xlabel()
    ax = D.plot_spectrogram(res)
    bars = [a for a in ax.figure.axes if a is not ax]
    assert len(bars) == 1 and bars[0].get_ylabel() == "dB"  # the dB colourbar
    axes = D.plot_audio(res)
    assert [a.get_ylabel() for a in axes[0].figure.axes] == ["amplitude", "kHz", "dB"]
    axes[0].figure.canvas.draw()
    w0, w1 = (a.get_window_extent().width for a in axes)
    assert abs(w0 - w1) < 1  # one colourbar for both rows: the waveform stays as wide as the spectrogram


def test_bench_colours_stay_per_backend_and_ticks_are_integers():
    import pandas as pd

    df = pd.DataFrame({"backend": ["eager", "eager", "vllm", "vllm", "vllm-workers", "vllm-workers"],
                       "concurrency": [1, 4, 1, 4, 1, 4], "ttfa_ms_p50": [10.0, 20, 30, 40, 50, 60]})
    colors = D.backend_colors(df["backend"])
    one = D.plot_bench(df, colors=colors)
    two = D.plot_bench(df[df["backend"] != "eager"], colors=colors)  # a row where a backend is missing
    got = [{ln.get_label(): ln.get_color() for ln in ax.get_lines()} for ax in (one, two)]
    assert got[0]["vllm"] == got[1]["vllm"] == colors["vllm"] and got[0]["vllm-workers"] == got[1]["vllm-workers"]
    assert len(set(got[0].values())) == 3
    assert [t.get_text() for t in one.get_xticklabels()] == ["1", "4"]


def test_pipeline_and_summary_render_as_tables(tiny_pipe, streamed):
    html = tiny_pipe._repr_html_()
    for what in ("checkpoint", "variant", "backend", "deploy", "dtype", "threads", "eager", "float32",
                 str(tiny_pipe.model.path)):
        assert what in html, what
    assert repr(tiny_pipe).startswith("Pipeline(tiny custom_voice,") and "backend='eager'" in repr(tiny_pipe)
    assert "tiny custom_voice" in html and "0b6" not in html  # the tiny checkpoint is named by its geometry
    s = streamed[1].summary()
    assert "<table>" in s._repr_html_() and s["frames"] == streamed[1].num_frames


def test_metric_tables_show_rounded_numbers(streamed):
    import re

    html = streamed[1]._repr_html_() + streamed[1].trace._repr_html_()
    assert not re.search(r"\d\.\d{5,}", html), "a table shows a float with 5+ decimals"
