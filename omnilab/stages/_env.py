"""Process-environment helper shared by the stage workers (plain Python)."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping


@contextlib.contextmanager
def temporary_environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (str) or unset (None) environment variables for the duration of the block, e.g. while spawning
    a worker process that must inherit them; restores the previous values afterwards."""
    def apply(items):
        for k, v in items:
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    old = {k: os.environ.get(k) for k in values}
    try:
        apply(values.items())
        yield
    finally:
        apply(old.items())
