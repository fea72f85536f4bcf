"""The ``omnilab`` command line: ``main`` (synth, bench, probe, plan) and ``profile`` (probe / plan).

May import anything (it is the top of the package); nothing imports ``cli``.
"""
from omnilab.cli.main import main

__all__ = ["main"]
