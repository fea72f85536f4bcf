"""Process-environment helpers shared by the stages and their workers (plain Python): ``temporary_environ`` and
``env_flag``, the one parser of omnilab's boolean environment variables (``OMNILAB_CPU_INDUCTOR``,
``OMNILAB_VLLM_PREDICTOR_PER_ROW``, vllm-omni's ``VLLM_OMNI_CPU_INDUCTOR``)."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

from omnilab import settings


def env_flag(environ: Mapping[str, str] | None, var: str) -> bool | None:
    """``var`` read as a boolean (:func:`omnilab.settings.flag`'s words; an ``OMNILAB_*`` name through the
    registry): None when unset or blank; anything but the accepted words raises ``ConfigError`` naming the
    variable, its value and those words, never a silent "off"."""
    if var.startswith("OMNILAB_"):
        return settings.flag(var, environ)
    return settings.parse_flag(var, (os.environ if environ is None else environ).get(var))


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
