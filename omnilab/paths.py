"""Where omnilab keeps files it makes (``cache_dir``) and the lock that serialises their creation.

Contract: ``cache_dir()`` is ``$OMNILAB_CACHE`` or ``~/.cache/omnilab`` (created on demand by the callers that
write); ``file_lock(path)`` is an exclusive ``flock`` on ``path`` (its folder created) for the ``with`` block,
so concurrent processes make a cached file once. A leaf: imports nothing from omnilab.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["cache_dir", "file_lock"]


def cache_dir() -> Path:
    """``$OMNILAB_CACHE`` or ``~/.cache/omnilab`` (created on demand by the callers that write)."""
    return Path(os.environ.get("OMNILAB_CACHE") or Path.home() / ".cache" / "omnilab").expanduser()


@contextlib.contextmanager
def file_lock(lock_path: Path):
    """Hold an exclusive lock on ``lock_path`` for the block (its folder is created)."""
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
