"""Live streaming panel for notebooks: an ipywidgets audio player that fills as ``pipe.stream(...)``
yields chunks, next to a plot redrawn per chunk (delivered audio vs playback, and the waveform so far).

``live_stream(pipe, text, **kwargs)`` runs one streamed synthesis through a ``LivePlayer`` and returns
the joined ``SynthesisResult``. Outside a notebook (no ipywidgets / no kernel) it still runs and returns
the result; the panel is then a no-op. ipywidgets and matplotlib are imported lazily.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class LivePlayer:
    """A panel: status line, ``ipywidgets.Audio`` (wav, no loop, no autoplay) and the plot as an
    ``ipywidgets.Image`` (PNG, redrawn per chunk).

    Call ``update(chunk)`` per ``AudioChunk`` and ``finish(result)`` at the end. ``normalize`` peak-
    normalises the player's audio (set False to hear the real level)."""

    def __init__(self, title: str = "", normalize: bool = True, plot: bool = True, autoplay: bool = False):
        self.title, self.normalize, self.plot, self.autoplay = title, normalize, plot, autoplay
        self.chunks: list[Any] = []
        self.widget = None
        try:
            import ipywidgets as w
        except ImportError:
            return
        self._audio = w.Audio(format="wav", autoplay=autoplay, loop=False, controls=True)
        self._status = w.HTML(value=f"<b>{title}</b> waiting for the first chunk...")
        self._plot = w.Image(format="png", layout={"width": "640px"})
        self.widget = w.HBox([w.VBox([self._status, self._audio], layout={"width": "340px"}), self._plot])

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget if self.widget is not None else repr(self))

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate([c.audio for c in self.chunks]) if self.chunks else np.zeros(0, np.float32)

    def update(self, chunk: Any) -> None:
        self.chunks.append(chunk)
        if self.widget is None:
            return
        from omnilab.display.plots import wav_bytes

        sr = chunk.sample_rate
        audio = self.audio
        self._audio.value = wav_bytes(audio, sr, self.normalize)
        self._status.value = (f"<b>{self.title}</b> chunk {len(self.chunks)}: frames {chunk.frame_end}, "
                              f"{len(audio) / sr:.2f} s audio, first audio at {1e3 * self.chunks[0].t_ready_s:.0f} ms, "
                              f"last chunk at {1e3 * chunk.t_ready_s:.0f} ms")
        if self.plot:
            self._redraw()

    def _redraw(self, result: Any = None) -> None:
        import io

        import matplotlib.pyplot as plt

        from omnilab.display.plots import plot_playback, plot_waveform

        fig, axes = plt.subplots(1, 2, figsize=(8, 2.4), layout="constrained")
        plot_playback(self.chunks if result is None or result.trace is None else result, axes[0])
        plot_waveform((self.audio, self.chunks[0].sample_rate), axes[1])
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=72)
        plt.close(fig)
        self._plot.value = buf.getvalue()  # an Image widget: no output capture, works in every frontend

    def finish(self, result: Any) -> None:
        if self.widget is None:
            return
        s = result.summary()
        self._status.value = (f"<b>{self.title}</b> done: {s['frames']} frames, {s['audio_s']} s audio, "
                              f"TTFA {s['ttfa_ms']} ms, RTF {s['rtf']} (wall/audio), {s['finish_reason']}")
        if self.plot and self.chunks:
            self._redraw(result)

    def __repr__(self) -> str:
        return f"LivePlayer(chunks={len(self.chunks)}, audio={len(self.audio) / 24000:.2f}s)"


def live_stream(pipe: Any, text: str, *, title: str | None = None, normalize: bool = True, plot: bool = True,
                display_panel: bool = True, **kwargs) -> Any:
    """Stream ``text`` through ``pipe`` into a :class:`LivePlayer` shown in the notebook; returns the
    joined ``SynthesisResult`` (with the request's trace). ``kwargs`` go to ``pipe.stream``."""
    from omnilab.results import SynthesisResult

    player = LivePlayer(title=title if title is not None else text[:60], normalize=normalize, plot=plot)
    if display_panel and player.widget is not None:
        from IPython.display import display

        display(player)
    for chunk in pipe.stream(text, **kwargs):
        player.update(chunk)
    result = SynthesisResult.from_chunks(player.chunks, text=text)
    player.finish(result)
    return result
