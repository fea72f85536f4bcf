"""Process-environment helpers shared by the stages and their workers (plain Python): ``temporary_environ`` and
``env_flag``, the one parser of omnilab's boolean environment variables (``OMNILAB_CPU_INDUCTOR``,
``OMNILAB_VLLM_PREDICTOR_PER_ROW``, vllm-omni's ``VLLM_OMNI_CPU_INDUCTOR``)."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

from omnilab.errors import ConfigError

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def env_flag(environ: Mapping[str, str] | None, var: str) -> bool | None:
    """``var`` read as a boolean: None when unset or blank; True / False for the words of :data:`TRUE_WORDS` /
    :data:`FALSE_WORDS` (any case); anything else raises ``ConfigError`` naming the variable, its value and the
    accepted words, never a silent "off"."""
    raw = (os.environ if environ is None else environ).get(var)
    if raw is None or not raw.strip():
        return None
    v = raw.strip().lower()
    if v in TRUE_WORDS:
        return True
    if v in FALSE_WORDS:
        return False
    raise ConfigError(f"{var}={raw!r}: accepted values are {' / '.join(TRUE_WORDS)} and {' / '.join(FALSE_WORDS)}")


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
