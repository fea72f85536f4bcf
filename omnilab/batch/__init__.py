"""Batch synthesis of a manifest (CSV / JSONL / Parquet) on a Ray cluster, or in this process without Ray.

- ``manifest``: reading and checking a manifest (``read_manifest``; every bad row is a ``RowError`` with its line);
- ``worker``: ``BatchWorker``, one ``Pipeline`` in one process (a Ray actor, or the driver without Ray);
- ``cluster``: connecting to Ray, one actor per NUMA node of each Ray node (CPUs reserved as Ray resources),
  dispatch, and the restart-and-retry of an utterance whose actor died;
- ``run``: ``synthesize(...)`` and ``BatchReport``: the output directory (``wav/<id>.wav`` written to a temporary
  name and renamed, ``records/<id>.json``, ``metrics.parquet``), resume, the progress bar.

An edge (layer 7, docs/architecture.md): may import everything below it (pipeline, profiles, hardware, config,
errors); nothing imports ``batch`` except the CLI. ``ray`` is optional (the ``cluster`` extra) and imported
only inside functions, so ``import omnilab.batch`` imports no torch, vLLM or Ray.
"""
from __future__ import annotations

from omnilab.batch.manifest import read_manifest
from omnilab.batch.run import BatchReport, synthesize

__all__ = ["synthesize", "read_manifest", "BatchReport"]
