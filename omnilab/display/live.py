"""Live streaming panel for notebooks: a Web Audio player that plays through a stream as ``pipe.stream(...)``
yields chunks, next to a plot redrawn per chunk (delivered audio vs playback, and the waveform so far).

``live_stream(pipe, text, **kwargs)`` runs one streamed synthesis through a ``LivePlayer`` and returns the joined
``SynthesisResult``. The player is an anywidget (``live_player.js``): each chunk is appended to what is playing
(its AudioBuffer scheduled right after the previous one), a marker shows the position, and the panel says it is
waiting until the first chunk arrives. When the stream ends, ``live_stream`` shows a static player of the final
audio (an ``<audio>`` element with the WAV inline) and the last plot, so a saved notebook plays when reopened,
whether or not the widget state was saved. Outside a notebook (no anywidget / no kernel) it still runs and returns
the result; the panel is then a no-op. anywidget, IPython and matplotlib are imported lazily.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from omnilab.display.plots import plot_playback, plot_waveform, wav_bytes
from omnilab.results import SynthesisResult

_ESM = Path(__file__).with_name("live_player.js")
_WIDGET_CLASS = None


def _widget_class():
    """The anywidget class (built once; None when anywidget is not installed)."""
    global _WIDGET_CLASS
    if _WIDGET_CLASS is None:
        try:
            import anywidget
            import traitlets as t
        except ImportError:
            return None

        class StreamPlayerWidget(anywidget.AnyWidget):
            _esm = _ESM
            chunks = t.List(t.Bytes()).tag(sync=True)  # float32 PCM per chunk, in stream order
            sample_rate = t.Int(24000).tag(sync=True)
            normalize = t.Bool(True).tag(sync=True)
            done = t.Bool(False).tag(sync=True)
            status = t.Unicode("").tag(sync=True)
            plot_png = t.Bytes(b"").tag(sync=True)

            def __repr__(self) -> str:  # the text a frontend without the widget shows
                return "omnilab live player (a widget: run the cell to see it; the final audio is below it)"

        _WIDGET_CLASS = StreamPlayerWidget
    return _WIDGET_CLASS


class LivePlayer:
    """A panel: status line, play/pause with a position marker (Web Audio, chunks appended while playing) and the
    plot (PNG, redrawn per chunk; a placeholder until the first chunk).

    Call ``update(chunk)`` per ``AudioChunk`` and ``finish(result)`` at the end; ``static()`` is the final audio
    and plot as plain HTML. ``normalize`` peak-normalises the playback (set False to hear the real level)."""

    def __init__(self, title: str = "", normalize: bool = True, plot: bool = True, autoplay: bool = False):
        self.title, self.normalize, self.plot, self.autoplay = title, normalize, plot, autoplay
        self.chunks: list[Any] = []
        self.result = None
        self.plot_png = b""
        cls = _widget_class()
        self.widget = None if cls is None else cls(normalize=normalize,
                                                   status=f"<b>{_esc(title)}</b> waiting for the first chunk...")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget if self.widget is not None else repr(self))

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate([c.audio for c in self.chunks]) if self.chunks else np.zeros(0, np.float32)

    @property
    def sample_rate(self) -> int:
        return int(self.chunks[0].sample_rate) if self.chunks else 24000

    def update(self, chunk: Any) -> None:
        self.chunks.append(chunk)
        if self.widget is None:
            return
        sr = chunk.sample_rate
        n = sum(len(c.audio) for c in self.chunks)
        pcm = np.ascontiguousarray(np.asarray(chunk.audio, np.float32).reshape(-1)).tobytes()
        with self.widget.hold_sync():
            self.widget.sample_rate = int(sr)
            self.widget.chunks = [*self.widget.chunks, pcm]
            self.widget.status = (f"<b>{_esc(self.title)}</b> chunk {len(self.chunks)}: frames {chunk.frame_end}, "
                                  f"{n / sr:.2f} s audio, first audio at {1e3 * self.chunks[0].t_ready_s:.0f} ms, "
                                  f"last chunk at {1e3 * chunk.t_ready_s:.0f} ms")
        if self.plot:
            self._redraw()

    def _redraw(self, result: Any = None) -> None:
        import io

        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(8, 2.4), layout="constrained")
        plot_playback(self.chunks if result is None or result.trace is None else result, axes[0])
        plot_waveform((self.audio, self.sample_rate), axes[1])
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80)
        plt.close(fig)
        self.plot_png = buf.getvalue()
        if self.widget is not None:
            self.widget.plot_png = self.plot_png  # bytes in the widget: no output capture, works in every frontend

    def finish(self, result: Any) -> None:
        self.result = result
        if self.widget is None:
            return
        s = result.summary()
        with self.widget.hold_sync():
            self.widget.done = True
            self.widget.status = (f"<b>{_esc(self.title)}</b> done: {s['frames']} frames, {s['audio_s']} s audio, "
                                  f"TTFA {s['ttfa_ms']} ms, RTF {s['rtf']} (wall/audio), {s['finish_reason']}")
        if self.plot and self.chunks:
            self._redraw(result)

    def static(self):
        """The final audio as an ``<audio>`` element (inline WAV) beside the last plot: plain HTML output that a
        reopened notebook still plays."""
        import base64

        from IPython.display import HTML

        wav = base64.b64encode(wav_bytes(self.audio, self.sample_rate, self.normalize)).decode("ascii")
        img = (f"<img alt='stream plot' style='max-width:640px' src='data:image/png;base64,"
               f"{base64.b64encode(self.plot_png).decode('ascii')}'/>" if self.plot_png else "")
        dur = len(self.audio) / self.sample_rate
        return HTML(f"<div class='omnilab-live-final'><div><b>{_esc(self.title)}</b> final audio ({dur:.2f} s, "
                    f"{len(self.chunks)} chunks)</div><audio controls preload='auto' "
                    f"src='data:audio/wav;base64,{wav}'></audio><div>{img}</div></div>")

    def __repr__(self) -> str:
        return f"LivePlayer(chunks={len(self.chunks)}, audio={len(self.audio) / self.sample_rate:.2f}s)"


def _esc(s: str) -> str:
    import html

    return html.escape(str(s))


def live_stream(pipe: Any, text: str, *, title: str | None = None, normalize: bool = True, plot: bool = True,
                display_panel: bool = True, **kwargs) -> Any:
    """Stream ``text`` through ``pipe`` into a :class:`LivePlayer` shown in the notebook, then show the static
    player of the final audio under it; returns the joined ``SynthesisResult`` (with the request's trace).
    ``kwargs`` go to ``pipe.stream``."""
    player = LivePlayer(title=title if title is not None else text[:60], normalize=normalize, plot=plot)
    shown = display_panel and player.widget is not None
    if shown:
        from IPython.display import display

        display(player)
    for chunk in pipe.stream(text, **kwargs):
        player.update(chunk)
    result = SynthesisResult.from_chunks(player.chunks, text=text)
    player.finish(result)
    if shown:
        display(player.static())
    return result
