"""How loud omnilab and the libraries under it are: ``set_verbosity``, ``OMNILAB_LOG_LEVEL``, ``--verbose``.

Contract (docs/architecture.md#verbosity):
- Levels (``LEVELS``): ``error``, ``warning`` (the default), ``info``, ``debug``. ``verbosity()`` reads
  ``OMNILAB_LOG_LEVEL`` (an unknown value raises :class:`~omnilab.errors.InputError` naming the accepted ones);
  ``set_verbosity(level)`` writes it, so worker processes started afterwards inherit the level.
- omnilab's own ``warnings.warn`` calls and its ``omnilab.*`` loggers at WARNING and above are always shown;
  ``info`` / ``debug`` also show the loggers' INFO / DEBUG records on stderr. Errors are never hidden:
  exceptions propagate, and ERROR records of vLLM still print at every level.
- Quiet (``error`` and ``warning``): :func:`quiet_libraries` (called before vLLM is imported or an engine
  starts, in this process and through the environment in every worker) sets vLLM's level to ERROR
  (``VLLM_LOGGING_LEVEL``, unless the user set it), drops the two ``torch.distributed.reduce_op``
  FutureWarnings vLLM's Triton dispatcher triggers (by message and category, here and through
  ``PYTHONWARNINGS`` in spawned processes) and lets :func:`native_notices` hide the NUMA binding notice vLLM's
  C++ worker init prints on stderr. ``info`` gives vLLM's WARNING lines back (what vLLM shows by default less
  its INFO chatter), ``debug`` vLLM's DEBUG.

Plain Python (stdlib only): a layer-0 module.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from typing import Iterator

from omnilab import settings
from omnilab.errors import InputError

ENV = "OMNILAB_LOG_LEVEL"
LEVELS = ("error", "warning", "info", "debug")
DEFAULT = "warning"
_PY_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}
# vLLM's level per omnilab level (quiet: only its errors)
VLLM_LEVELS = {"error": "ERROR", "warning": "ERROR", "info": "WARNING", "debug": "DEBUG"}
# Python warnings that third-party imports raise on every start, matched exactly (message start + category)
NOISY_WARNINGS = (("`torch.distributed.reduce_op` is deprecated", FutureWarning),)
# lines C++ code prints on stderr that carry no action for the user (matched as regular expressions)
NATIVE_NOTICES = (r"Warning: NUMA binding: Using (MEMBIND|INTERLEAVE) policy for memory allocation",)

_ours: dict[str, str] = {}          # environment values this module set (only those are changed again)
_filters: list[tuple] = []          # warnings filters this module installed
_handler: logging.Handler | None = None


def verbosity() -> str:
    """The current level: ``OMNILAB_LOG_LEVEL`` (case-insensitive) or ``warning``."""
    given = settings.raw(ENV) or ""
    raw = given.strip().lower()
    if not raw:
        return DEFAULT
    if raw not in LEVELS:
        raise InputError(f"{ENV}={given!r}; accepted: {', '.join(LEVELS)}")
    return raw


def quiet() -> bool:
    """True where third-party chatter is hidden (``error`` and ``warning``)."""
    return verbosity() in ("error", "warning")


def set_verbosity(level: str) -> str:
    """Set how much omnilab and vLLM/torch/Triton print: ``"error"``, ``"warning"`` (default: omnilab's warnings,
    third-party errors only), ``"info"`` (also omnilab's info and vLLM's warnings) or ``"debug"``. Applies to this
    process now and to worker processes started afterwards; a vLLM engine already running keeps its level.
    Returns the level set."""
    value = str(level).strip().lower()
    if value not in LEVELS:
        raise InputError(f"verbosity {level!r}; accepted: {', '.join(LEVELS)}")
    os.environ[ENV] = value
    quiet_libraries()
    return value


def _set_env(key: str, value: str | None) -> None:
    """Set ``key`` unless the user set it (a value this module did not write); None removes ours."""
    current = os.environ.get(key)
    if current is not None and _ours.get(key) != current:
        return  # the user's own setting wins
    if value is None:
        if current is not None:
            del os.environ[key]
        _ours.pop(key, None)
    else:
        os.environ[key] = _ours[key] = value


def _pythonwarnings(add: bool) -> None:
    """Our entries in ``PYTHONWARNINGS`` (read by every spawned Python process), added or removed."""
    entries = [f"ignore:{msg}:{cat.__name__}" for msg, cat in NOISY_WARNINGS]
    current = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e and e not in entries]
    value = ",".join(current + (entries if add else []))
    if value:
        os.environ["PYTHONWARNINGS"] = value
    else:
        os.environ.pop("PYTHONWARNINGS", None)


def quiet_libraries(vllm_level: str | None = None) -> str:
    """Apply the current verbosity to this process and to the environment worker processes inherit; call before
    vLLM is imported or an engine starts. ``vllm_level`` (e.g. ``VllmStageConfig.log_level``) overrides the level
    the verbosity gives vLLM; a user's ``VLLM_LOGGING_LEVEL`` wins over both. Returns vLLM's level."""
    global _handler
    level = verbosity()
    is_quiet = level in ("error", "warning")
    vlevel = (vllm_level or VLLM_LEVELS[level]).upper()
    _set_env("VLLM_LOGGING_LEVEL", vlevel)
    vlevel = os.environ.get("VLLM_LOGGING_LEVEL", vlevel).upper()
    # vLLM logs a few warnings at import, before it configures its logger (Python's last-resort handler prints
    # them): the level of the 'vllm' logger filters those too; vLLM's own configuration later sets the same level
    logging.getLogger("vllm").setLevel(getattr(logging, vlevel, logging.WARNING))
    while _filters:
        with contextlib.suppress(ValueError):
            warnings.filters.remove(_filters.pop())
    if is_quiet:
        for msg, cat in NOISY_WARNINGS:
            warnings.filterwarnings("ignore", message=re.escape(msg), category=cat)
            _filters.append(warnings.filters[0])
    _pythonwarnings(is_quiet)
    own = logging.getLogger("omnilab")
    own.setLevel(_PY_LEVELS[level] if level in ("info", "debug") else logging.NOTSET)
    if level in ("info", "debug") and _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter("omnilab %(levelname)s %(name)s: %(message)s"))
        own.addHandler(_handler)
    elif level not in ("info", "debug") and _handler is not None:
        own.removeHandler(_handler)
        _handler = None
    return vlevel


def quiet_vllm_import() -> None:
    """At ``import omnilab``: while quiet, the 'vllm' logger's level (if nobody set one) filters the warnings vLLM
    logs while it is imported, before its logging is configured. Spawned worker processes import the parent's main
    script (the ``omnilab`` command, a user's script importing omnilab) before vLLM, so they get it too."""
    with contextlib.suppress(InputError):
        vllm = logging.getLogger("vllm")
        if quiet() and vllm.level == logging.NOTSET:
            vllm.setLevel(logging.ERROR)


@contextlib.contextmanager
def native_notices() -> Iterator[None]:
    """While quiet, drop the :data:`NATIVE_NOTICES` lines that C++ code in the block writes to file descriptor 2;
    every other byte written there is passed on when the block ends (also when it raises). Wrap only single
    calls known to print such a notice (vLLM's ``init_cpu_memory_env``); not thread-safe against other writers."""
    if not quiet():
        yield
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            pattern = re.compile("|".join(NATIVE_NOTICES).encode())
            kept = [ln for ln in tmp.read().splitlines(keepends=True) if not pattern.search(ln)]
            if kept:
                os.write(2, b"".join(kept))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``-v/--verbose`` (repeatable) on a command line: ``-v`` = info (vLLM's warnings back), ``-vv`` = debug."""
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help=f"show more: -v info and vLLM's warnings, -vv debug (default: {ENV}, else warnings)")


def apply_arguments(args: argparse.Namespace) -> str:
    """Set the verbosity ``--verbose`` asks for (nothing when not given). Returns the level in effect."""
    count = getattr(args, "verbose", 0) or 0
    if count:
        return set_verbosity("debug" if count > 1 else "info")
    quiet_libraries()
    return verbosity()


__all__ = ["LEVELS", "ENV", "verbosity", "set_verbosity", "quiet", "quiet_libraries", "quiet_vllm_import", "native_notices",
           "add_arguments", "apply_arguments"]
