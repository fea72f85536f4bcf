"""Benchmarks: ``omnilab bench`` (``run``), its drivers (backends, streams, floors) and the talker-step
micro-benchmark (``talker_step``).

May import anything below it (pipeline, stages, profiles, kernels, checkpoint, instrument, display);
nothing in the package imports ``bench`` except the CLI.
"""
