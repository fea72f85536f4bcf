"""Instrumentation as data: spans, traces, hooks, the pipeline's recorder and the CPU sampler.

``trace`` (``Span``, ``Trace``: DataFrames, invariants, exports through ``export`` (Perfetto JSON) and
``tables`` (CSV/Parquet with the run's metadata)), ``hooks`` (what users
attach: ``TimingHook``, ``ThreadUsageHook``, ``ProgressHook``, callables), ``recorder`` (the pipeline's side
that emits spans), ``sampler`` (per-thread and per-core CPU samples), ``progress`` (tqdm bars for long work,
``OMNILAB_PROGRESS``).

May import: the leaves (``errors``, ``config``, ``html_tables``), ``logs``, numpy/pandas and (lazily) tqdm. Never a stage, the
pipeline or ``display`` (display renders this data, not the other way round).
"""
