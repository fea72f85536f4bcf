"""Progress bars for long work (random checkpoints, loading, quantization, synthesis frames): ``tqdm.auto``,
imported only when a bar is made.

Contract:
- ``progress_enabled(progress=None) -> bool | None``: an explicit ``progress`` wins; else ``OMNILAB_PROGRESS``
  (``1``/``on``/``true`` or ``0``/``off``/``false``; anything else raises :class:`~omnilab.errors.InputError`);
  else off at verbosity ``error`` (``omnilab.logs``) and in worker processes (their stderr is not the user's);
  else ``None``: tqdm decides (a bar on a terminal, none when stderr is a file or pipe), and in a Jupyter kernel
  a bar widget.
- ``bar(iterable=None, *, total, desc, unit, progress=None)``: a tqdm bar, or a silent stand-in with the same
  ``update`` / ``set_postfix_str`` / ``close`` / iteration / context-manager methods when disabled. Bars appear
  only after ``DELAY_S`` (work that ends sooner prints nothing) and vanish when done (``leave=False``).
"""
from __future__ import annotations

import multiprocessing
import sys
from typing import Any, Iterable

from omnilab import settings
from omnilab.errors import InputError
from omnilab.logs import verbosity

ENV = "OMNILAB_PROGRESS"
DELAY_S = 0.5  # a bar appears only for work longer than this (tqdm's delay=)
_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def _in_kernel() -> bool:
    ip = sys.modules.get("IPython")
    get = getattr(ip, "get_ipython", None)
    shell = get() if callable(get) else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def progress_enabled(progress: bool | None = None) -> bool | None:
    """True / False where decided, None where tqdm decides from the terminal (see the module docstring)."""
    if progress is not None:
        return bool(progress)
    given = settings.raw(ENV) or ""
    raw = given.strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    if raw:
        raise InputError(f"{ENV}={given!r}; accepted: 1/on/true, 0/off/false")

    if verbosity() == "error" or multiprocessing.parent_process() is not None:
        return False
    return True if _in_kernel() else None


class _Silent:
    """A disabled bar: iterates its iterable, ignores updates."""
    disable = True

    def __init__(self, iterable: Iterable | None = None):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def bar(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "", unit: str = "it",
        progress: bool | None = None, **kw: Any):
    """A progress bar over ``iterable`` (or one to ``update`` by hand), as :func:`progress_enabled` says."""
    enabled = progress_enabled(progress)
    if enabled is False:
        return _Silent(iterable)
    from tqdm.auto import tqdm

    kw.setdefault("delay", DELAY_S)
    kw.setdefault("leave", False)
    args = () if iterable is None else (iterable,)
    return tqdm(*args, total=total, desc=desc, unit=unit, disable=None if enabled is None else False, **kw)


__all__ = ["ENV", "progress_enabled", "bar"]
