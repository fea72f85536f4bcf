"""Result objects returned by the pipeline: plain data (numpy), short reprs, inline HTML.

``SynthesisResult`` holds one utterance: codes ``[T, 16]``, float32 audio at 24 kHz, and the
``omnilab.instrument.trace.Trace`` recorded while it was produced (spans per stage/step/chunk; thread samples when
a ``ThreadUsageHook`` ran). ``AudioChunk`` is what ``Pipeline.stream`` yields; the last one of a request
carries the request's trace, and ``SynthesisResult.from_chunks`` joins a stream into one result.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from omnilab.config import SAMPLE_RATE, SAMPLES_PER_FRAME
from omnilab.html_tables import Summary, key_value_table

if TYPE_CHECKING:
    from omnilab.instrument.trace import Trace


@dataclass
class SynthesisResult:
    """One synthesized utterance.

    Attributes:
        codes: ``[T, 16]`` int64 codec frames (T frames of 80 ms).
        audio: ``[T * 1920]`` float32 waveform in [-1, 1] at ``sample_rate``.
        sample_rate: always 24000.
        request_id: the id the talker stage used.
        finish_reason: ``"eos"`` (the model stopped), ``"length"`` (hit max_new_tokens) or ``"abort"``.
        seed: the talker/sub-talker seed actually used (reproduce a sampled run with it).
            of the trace's spans when there is a trace.
        wall_s: wall time from request admission to the last audio delivered.
        ttfa_ms: time to first audio (first decoded chunk) for streamed runs, else time to the full audio.
        trace: the request's ``omnilab.instrument.trace.Trace`` (``trace.metrics()``, ``trace.to_pandas()``, ...).
    """

    codes: np.ndarray
    audio: np.ndarray
    sample_rate: int = SAMPLE_RATE
    request_id: str = ""
    text: str | None = None
    finish_reason: str = ""
    seed: int | None = None
    wall_s: float = 0.0
    ttfa_ms: float | None = None
    hidden: np.ndarray | None = None  # [T, H] talker hidden states, only when asked for
    trace: "Trace | None" = field(default=None, repr=False)

    @classmethod
    def from_chunks(cls, chunks: Iterable["AudioChunk"], text: str | None = None) -> "SynthesisResult":
        """Join streamed chunks (in order) into one result; metrics come from the last chunk's trace."""
        chunks = list(chunks)
        audio = np.concatenate([c.audio for c in chunks]) if chunks else np.zeros(0, np.float32)
        codes = np.concatenate([c.codes for c in chunks]) if chunks else np.zeros((0, 16), np.int64)
        trace = chunks[-1].trace if chunks else None
        kw: dict[str, Any] = {}
        if trace is not None and trace.request_ids:
            m = trace.request_metrics(chunks[-1].request_id)
            kw = {"wall_s": m["wall_ms"] / 1e3, "ttfa_ms": m["ttfa_ms"], "finish_reason": m["finish_reason"]}
        elif chunks:
            kw = {"wall_s": chunks[-1].t_ready_s, "ttfa_ms": 1e3 * chunks[0].t_ready_s}
        return cls(codes=codes.astype(np.int64), audio=audio.astype(np.float32, copy=False),
                   request_id=chunks[0].request_id if chunks else "", text=text, trace=trace, **kw)

    @property
    def num_frames(self) -> int:
        return int(self.codes.shape[0])

    @property
    def duration_s(self) -> float:
        return len(self.audio) / self.sample_rate

    @property
    def rtf(self) -> float:
        """Real-time factor = wall time / audio duration (lower is better; < 1 is faster than real time)."""
        return self.wall_s / self.duration_s if self.duration_s else float("inf")

    @property
    def x_realtime(self) -> float:
        """Audio duration / wall time (higher is better): the inverse of ``rtf``."""
        return self.duration_s / self.wall_s if self.wall_s else float("inf")

    def timings_frame(self):
        """One row per span of the trace (``Trace.to_pandas``); empty when the result has no trace. The run's
        metadata (``Trace.meta``) is in ``.attrs["omnilab"]``: ``omnilab.instrument.tables.write_table(df, path,
        df.attrs["omnilab"])`` writes it into a CSV or Parquet file."""
        import pandas as pd

        df = self.trace.to_pandas() if self.trace is not None else pd.DataFrame()
        df.attrs["omnilab"] = dict(self.trace.meta) if self.trace is not None else {}
        return df

    def stage_ms_per_frame(self) -> dict[str, float]:
        """Total milliseconds per generated frame for each ``stage.name`` span kind (instants and the
        request span excluded)."""
        out: dict[str, float] = {}
        n = max(self.num_frames, 1)
        spans = self.trace.spans if self.trace is not None else []
        for sp in spans:
            if sp.name not in ("request", "deliver"):
                key = f"{sp.stage}.{sp.name}"
                out[key] = out.get(key, 0.0) + float(sp.duration_ms)
        return {k: v / n for k, v in out.items()}

    def save_wav(self, path: str | Path) -> Path:
        import soundfile as sf

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        sf.write(str(path), self.audio, self.sample_rate, subtype="FLOAT")
        return path

    def play(self, normalize: bool = True):
        """An inline audio player (``IPython.display.Audio``)."""
        from IPython.display import Audio

        return Audio(self.audio, rate=self.sample_rate, normalize=normalize)

    def summary(self) -> dict[str, Any]:
        """The result's figures: a dict that shows as a table in a notebook (``omnilab.html_tables.Summary``)."""
        extra: dict[str, Any] = {}
        if self.trace is not None and self.trace.request_ids:
            m = self.trace.request_metrics(self.request_id or None)
            extra = {k: round(m[k], 1) for k in ("playback_start_ms", "stall_ms", "talker_ms_per_frame",
                                                 "code2wav_ms_per_frame")}
        return Summary({
            "request_id": self.request_id,
            "frames": self.num_frames,
            "audio_s": round(self.duration_s, 3),
            "wall_s": round(self.wall_s, 3),
            "rtf": round(self.rtf, 3),
            "x_realtime": round(self.x_realtime, 3),
            "ttfa_ms": None if self.ttfa_ms is None else round(self.ttfa_ms, 1),
            "finish_reason": self.finish_reason,
            **extra,
        })

    def __repr__(self) -> str:
        return (f"SynthesisResult(frames={self.num_frames}, audio={self.duration_s:.2f}s, "
                f"rtf={self.rtf:.2f}, finish={self.finish_reason!r})")

    def _repr_html_(self) -> str:
        player = ""
        try:
            player = self.play()._repr_html_()
        except Exception:  # IPython missing: table only
            pass
        return f"<div><b>SynthesisResult</b>{key_value_table(self.summary())}{player}</div>"


@dataclass
class AudioChunk:
    """A piece of streamed audio: ``audio`` float32 at 24 kHz covering frames ``[frame_start, frame_end)``."""

    request_id: str
    audio: np.ndarray
    frame_start: int
    frame_end: int
    codes: np.ndarray  # [F, 16] the frames this chunk decodes
    t_ready_s: float  # seconds since the request started when this chunk was ready
    is_last: bool = False
    sample_rate: int = SAMPLE_RATE
    trace: "Trace | None" = field(default=None, repr=False)  # the request's trace, on its last chunk

    @property
    def num_frames(self) -> int:
        return self.frame_end - self.frame_start

    @property
    def duration_s(self) -> float:
        return self.num_frames * SAMPLES_PER_FRAME / self.sample_rate

    def __repr__(self) -> str:
        return (f"AudioChunk({self.request_id!r}, frames {self.frame_start}:{self.frame_end}, "
                f"ready at {self.t_ready_s * 1000:.0f} ms{', last' if self.is_last else ''})")
