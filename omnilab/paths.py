"""Where omnilab keeps files it makes (``cache_dir``), private folders under it, and the lock that serialises
their creation.

Contract: ``cache_dir()`` is ``$OMNILAB_CACHE`` or ``~/.cache/omnilab`` (created on demand by the callers that
write). ``private_dir(path)`` creates ``path`` and every missing folder above it with mode 0700 whatever the
umask (folders that exist keep their mode) and returns it; a path that cannot be a writable folder (a file is in
the way, no permission) raises ``ConfigError`` naming it, and naming ``OMNILAB_CACHE`` when it lies under the
cache. Every folder omnilab makes under the cache goes through it. ``file_lock(path)`` is an exclusive ``flock``
on ``path`` (its folder made private) for the ``with`` block, so concurrent processes make a cached file once.
A leaf: imports only ``omnilab.errors``.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from omnilab import settings
from omnilab.errors import ConfigError

__all__ = ["cache_dir", "file_lock", "private_dir"]

PRIVATE_MODE = 0o700  # cache folders hold code (compiled kernels) and checkpoints: this user only


def cache_dir() -> Path:
    """``$OMNILAB_CACHE`` or ``~/.cache/omnilab`` (created on demand by the callers that write)."""
    return Path(settings.raw("OMNILAB_CACHE") or Path.home() / ".cache" / "omnilab").expanduser()


def _unusable(path: Path, why: str) -> ConfigError:
    root = cache_dir()
    try:
        under = path.absolute().is_relative_to(root.absolute())
    except (OSError, ValueError):
        under = False
    if not under:
        return ConfigError(f"{path} cannot be used as a folder: {why}; accepted: a writable directory")
    given = settings.raw("OMNILAB_CACHE")
    name = (f"OMNILAB_CACHE={given!r}" if given
            else f"the cache folder {str(root)!r} (OMNILAB_CACHE unset)")
    return ConfigError(f"{name} cannot be used: {path}: {why}; accepted: OMNILAB_CACHE set to a writable "
                       "directory you own (or a missing one omnilab may create)")


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` as a writable folder; each missing level is created with mode 0700 regardless of the umask."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and not p.is_symlink() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d, PRIVATE_MODE)
            except FileExistsError:  # made by a concurrent process: keep its mode
                continue
            os.chmod(d, PRIVATE_MODE)  # mkdir's mode is masked by the umask
    except OSError as e:
        raise _unusable(path, e.strerror or str(e)) from None
    if not path.is_dir():
        raise _unusable(path, "it exists and is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise _unusable(path, "no permission to write in it")
    return path


@contextlib.contextmanager
def file_lock(lock_path: Path):
    """Hold an exclusive lock on ``lock_path`` for the block (its folder is created, private)."""
    import fcntl

    private_dir(lock_path.parent)
    with open(lock_path, "a+", opener=lambda p, flags: os.open(p, flags, 0o600)) as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
