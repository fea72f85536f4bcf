"""The live streaming player: chunks appended to the widget in stream order, a placeholder before the first,
a static player of the final audio that works without the widget, and a table summary."""
from __future__ import annotations

import base64
import io
import re
import wave

import numpy as np
import pytest

from _deps import need  # noqa: E402

need("anywidget")
need("IPython")
matplotlib = need("matplotlib")
matplotlib.use("Agg")

from omnilab import display as D  # noqa: E402
from omnilab.results import SynthesisResult  # noqa: E402

KW = dict(speaker="vivian", language="english", max_new_tokens=8, do_sample=False, subtalker_do_sample=False)


def test_chunks_are_appended_in_order_and_the_player_waits_before_the_first(tiny_pipe):
    p = D.LivePlayer(title="t")
    assert p.widget.chunks == [] and "waiting for the first chunk" in p.widget.status
    assert p.widget.plot_png == b""  # no image before the first chunk (the panel shows a placeholder)
    chunks = list(tiny_pipe.stream("Again and again.", chunk_schedule=None, **KW))
    assert len(chunks) >= 2
    for i, c in enumerate(chunks, 1):
        p.update(c)
        assert len(p.widget.chunks) == i  # appended, never replaced
        assert p.widget.plot_png[:4] == b"\x89PNG"
    for c, pcm in zip(chunks, p.widget.chunks):  # each chunk's own samples, as float32, in stream order
        np.testing.assert_array_equal(np.frombuffer(pcm, np.float32), c.audio)
    assert not p.widget.done
    res = SynthesisResult.from_chunks(chunks)
    p.finish(res)
    assert p.widget.done and "done" in p.widget.status


def test_static_player_holds_the_whole_audio(tiny_pipe):
    res = D.live_stream(tiny_pipe, "Live and loud.", display_panel=False, **KW)
    assert isinstance(res, SynthesisResult) and res.trace is not None and res.num_frames > 0
    p = D.LivePlayer()
    for c in tiny_pipe.stream("Live and loud.", **KW):
        p.update(c)
    p.finish(SynthesisResult.from_chunks(p.chunks))
    html = p.static().data
    wav = base64.b64decode(re.search(r"data:audio/wav;base64,([A-Za-z0-9+/=]+)", html).group(1))
    with wave.open(io.BytesIO(wav)) as w:
        assert w.getnframes() == sum(len(c.audio) for c in p.chunks) and w.getframerate() == 24000
    assert "<audio controls" in html and "data:image/png;base64," in html


def test_widget_text_fallback_is_no_widget_repr():
    bundle = D.LivePlayer().widget._repr_mimebundle_()[0]
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "HBox" not in bundle["text/plain"] and "live player" in bundle["text/plain"]


def test_live_summary_is_a_table(tiny_pipe):
    res = D.live_stream(tiny_pipe, "A table, please.", display_panel=False, plot=False, **KW)
    s = res.summary()
    assert "<table>" in s._repr_html_() and s["frames"] == res.num_frames
