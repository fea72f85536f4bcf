"""Fidelity measured, not assumed: how closely a test pipeline (quantized, another dtype, another backend) follows
a reference pipeline on the same texts, by teacher forcing (docs/quality.md).

- ``run``: ``compare(ref_pipe, test_pipe, texts, **generation) -> QualityReport``; ``reference(...)`` computes the
  reference side once (a ``ReferenceRun``) for several ``compare(run, test_pipe)`` calls;
- ``teacher``: one pipeline's talker and code predictor replayed on another run's frames;
- ``metrics``: top-1 agreement, KL, per-codebook agreement, waveform SNR;
- ``report``: ``QualityReport`` (a DataFrame per request, ``summary()``, repr and ``_repr_html_``).

An edge layer like ``bench/``: may import anything below it (pipeline, requests, stages' results, models,
sampling, html_tables); nothing in the package imports ``quality`` except ``bench/`` and ``cli/``. Importing it
imports torch and pandas, so ``import omnilab`` never does.
"""
from __future__ import annotations

from omnilab.quality.report import QualityReport
from omnilab.quality.run import ReferenceRun, compare, reference

__all__ = ["QualityReport", "ReferenceRun", "compare", "reference"]
