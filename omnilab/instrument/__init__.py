"""Instrumentation as data: spans, traces, hooks, the pipeline's recorder and the CPU sampler.

``trace`` (``Span``, ``Trace``: DataFrames, invariants, exports through ``export``), ``hooks`` (what users
attach: ``TimingHook``, ``ThreadUsageHook``, ``ProgressHook``, callables), ``recorder`` (the pipeline's side
that emits spans), ``sampler`` (per-thread and per-core CPU samples).

May import: the leaves (``errors``, ``config``, ``html_tables``) and numpy/pandas. Never a stage, the
pipeline or ``display`` (display renders this data, not the other way round).
"""
