"""Benchmarks: ``omnilab bench``, one benchmark for every side-by-side comparison, and the talker-step micro-benchmark.

- ``run``: the command line and ``run_bench(BenchConfig)``; ``modes``: one after the other, ``--fresh``
  processes, ``--interleave`` rounds;
- ``backends``: configuration names (base + ``+modifiers``), how each is built, what one run measures;
- ``drivers``: streaming requests through the public ``Pipeline`` API and the figures of one point;
- ``floors``: bytes per frame and the GEMV probes (the memory-bandwidth floor next to each row);
- ``memory``: peak RSS of the process tree and run-queue wait; ``reference``: the official qwen-tts row;
- ``results``: the printed table and the JSON (``load_bench``);
- ``talker_step``: ``python -m omnilab.bench.talker_step``, the eager talker step on a random model.

May import anything below it (pipeline, stages, profiles, kernels, checkpoint, instrument, display);
nothing in the package imports ``bench`` except the CLI.
"""
