"""Prometheus metrics of the speech server (one registry per app): requests by outcome, TTFA and RTF histograms,
frames and audio produced, running and waiting requests. Gauge names follow vLLM's (``vllm:num_requests_running``,
``vllm:num_requests_waiting``); the speech-specific ones use the ``omnilab:`` prefix the same way."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

TTFA_BUCKETS_S = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
disable_created_metrics()  # vLLM does the same: no *_created series
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class ServeMetrics:
    """Counters, histograms and gauges; ``render()`` -> Prometheus text."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.model_name = model_name
        self.requests = Counter("omnilab:speech_requests", "Speech requests by outcome "
                                "(ok, client_error, server_error, aborted, unavailable)", lab + ["status"], registry=r)
        self.ttfa = Histogram("omnilab:time_to_first_audio_seconds", "Time from admission to the first audio chunk",
                              lab, buckets=TTFA_BUCKETS_S, registry=r)
        self.rtf = Histogram("omnilab:real_time_factor", "Wall time / audio duration of a completed request",
                             lab, buckets=RTF_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", lab,
                             buckets=TTFA_BUCKETS_S, registry=r)
        self.frames = Counter("omnilab:generation_frames", "Codec frames generated (80 ms of audio each)", lab,
                              registry=r)
        self.audio_s = Counter("omnilab:audio_seconds", "Seconds of audio delivered", lab, registry=r)
        self.fps = Gauge("omnilab:frames_per_second", "Frames generated per second over the last 10 s", lab,
                         registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests generating in the engine", lab, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot (queue depth)", lab,
                             registry=r)
        self.restarts = Counter("omnilab:engine_restarts", "Pipeline restarts after an engine death", lab, registry=r)
        self._window: list[tuple[float, int]] = []

    def count(self, status: str) -> None:
        self.requests.labels(self.model_name, status).inc()

    def add_frames(self, n: int) -> None:
        now = time.monotonic()
        self.frames.labels(self.model_name).inc(n)
        self._window = [(t, k) for t, k in self._window if now - t < 10.0] + [(now, n)]

    def render(self) -> bytes:
        now = time.monotonic()
        self._window = [(t, k) for t, k in self._window if now - t < 10.0]
        span = min(10.0, now - self._window[0][0]) if self._window else 0.0
        self.fps.labels(self.model_name).set(sum(k for _, k in self._window) / max(span, 1.0))
        return generate_latest(self.registry)
