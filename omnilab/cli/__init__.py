"""The ``omnilab`` command line: ``main`` (the dispatcher, ``--help`` / ``--version`` / ``help``, synth, make-checkpoint),
``speakers``, ``quantize`` and ``profile`` (probe / plan); ``bench`` lives in ``omnilab.bench.run``.

May import anything (it is the top of the package); nothing imports ``cli``.
"""
from omnilab.cli.main import main

__all__ = ["main"]
