"""Display functions on the Agg backend return artists; players, HTML reprs, the live panel."""
from __future__ import annotations

import io
import subprocess
import sys
import wave

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
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


def test_plots_without_samples_say_so():
    from omnilab.instrument.trace import Trace

    ax = D.plot_core_heatmap(Trace())
    assert "ThreadUsageHook" in ax.texts[0].get_text()


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
    pytest.importorskip("IPython")
    _, res = streamed
    a = D.audio_player(res)
    b = D.audio_player(res, normalize=False)
    assert "<audio" in a._repr_html_() and a.data[:4] == b"RIFF" and a.data != b.data


def test_html_reprs(streamed):
    _, res = streamed
    assert "<table" in res._repr_html_() and "<audio" in res._repr_html_()
    html = res.trace._repr_html_()
    assert "ttfa_ms" in html and "Trace(" in repr(res.trace)


def test_live_player_fills_per_chunk(tiny_pipe):
    pytest.importorskip("ipywidgets")
    res = D.live_stream(tiny_pipe, "Live and loud.", display_panel=False, **KW)
    assert isinstance(res, SynthesisResult) and res.trace is not None and res.num_frames > 0
    p = D.LivePlayer()
    chunks = list(tiny_pipe.stream("Again.", **KW))
    for c in chunks:
        p.update(c)
        assert p._audio.value[:4] == b"RIFF" and not p._audio.loop
        assert p._plot.value[:4] == b"\x89PNG"  # the plot is redrawn per chunk
    with wave.open(io.BytesIO(p._audio.value)) as w:
        assert w.getnframes() == sum(len(c.audio) for c in chunks)


def test_import_display_stays_light():
    code = ("import sys, omnilab, omnilab.display.plots, omnilab.instrument.hooks, omnilab.instrument.trace, omnilab.bench.run;"
            "bad=[m for m in ('matplotlib','ipywidgets','IPython','vllm','torch') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
