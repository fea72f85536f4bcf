"""Which cached kernel library may be loaded into this process, and loading it (docs/kernels.md#build-and-cache).

A compiled library runs code as soon as it is loaded (its constructors), so a file in the cache is loaded only
when it is a regular file owned by this user, neither it nor its folder is group- or world-writable, and its
sha256 equals the digest this user recorded beside it (``<library>.sha256``, written after the build, before
the library itself is renamed into place). :func:`untrusted_reason` says why a file fails (``build_library``
then compiles a fresh private file over it); :func:`open_library` checks the very file it loads (folder and
file opened once, hashed and ``dlopen``-ed through ``/proc/self/fd``, so a swap between check and load is
refused too) and raises :class:`KernelTrustError` naming the file and the reason. :func:`symbol` turns a
missing symbol into a :class:`KernelBuildError`, so ``auto`` falls back to torch with that reason.
Plain Python (ctypes, hashlib): no torch.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

DIGEST_SUFFIX = ".sha256"
_LOADED: dict[tuple[int, int, str], ctypes.CDLL] = {}  # (st_dev, st_ino, sha256) -> library
_PINNED: list[int] = []  # fds of loaded libraries: their /proc/self/fd names are never reused by another library


class KernelBuildError(RuntimeError):
    """The compiler is missing or failed, or a library cannot be used; the message names the file or command."""


class KernelTrustError(KernelBuildError):
    """A cached library fails the owner / mode / digest checks and was not loaded."""


def digest_path(lib: Path) -> Path:
    return lib.with_name(lib.name + DIGEST_SUFFIX)


def _fault(st: os.stat_result, what: str) -> str | None:
    """Why a file or folder with this ``lstat`` may not vouch for a library, or None."""
    if st.st_uid != os.geteuid():
        return f"{what} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_dir(d: Path) -> None:
    """Make ``d`` (this user's kernel folder) fit to hold libraries: a group/world-writable folder of this user is
    made 0700 (each file in it is checked on its own); a folder of another user, or a symlink, is refused."""
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise KernelTrustError(f"kernel cache {d} is not a directory (a symlink or a file); omnilab loads kernels "
                               "only from a directory of this user: set OMNILAB_CACHE to a private directory")
    if st.st_uid != os.geteuid():
        raise KernelTrustError(f"kernel cache {d} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); "
                               "omnilab neither loads nor builds kernels there: set OMNILAB_CACHE to a private "
                               "directory")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.chmod(d, 0o700)


def _read_digest(dfd: int, name: str) -> tuple[str | None, str | None]:
    """``(hex digest, None)`` or ``(None, reason)`` for the digest file ``name`` in the folder ``dfd``."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None, f"no digest recorded ({name} is missing): not built by this user's omnilab"
    except OSError as e:
        return None, f"cannot read {name}: {e.strerror}"
    try:
        st = os.fstat(fd)
        bad = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else _fault(st, name)
        if bad:
            return None, bad
        text = os.read(fd, 4096).decode("ascii", "replace").split()
    finally:
        os.close(fd)
    if not text or len(text[0]) != 64:
        return None, f"{name} holds no sha256 digest"
    return text[0].lower(), None


def _read_fd(fd: int) -> bytes:
    chunks = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def _inspect(path: Path) -> tuple[int | None, bytes | None, str | None]:
    """``(fd, content, None)`` for a library that passes every check (the fd stays open), else
    ``(None, None, reason)``."""
    try:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return None, None, f"cannot open its folder: {e.strerror}"
    fd = None
    try:
        bad = _fault(os.fstat(dfd), f"its folder {path.parent}")
        if bad:
            return None, None, bad
        try:
            fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            return None, None, "it does not exist"
        except OSError as e:
            return None, None, f"cannot open it without following links: {e.strerror}"
        st = os.fstat(fd)
        bad = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else _fault(st, "the file")
        if bad is None:
            want, bad = _read_digest(dfd, path.name + DIGEST_SUFFIX)
            if bad is None:
                data = _read_fd(fd)
                got = hashlib.sha256(data).hexdigest()
                if got != want:
                    bad = f"its sha256 {got[:16]}... differs from the digest recorded at build time {want[:16]}..."
                else:
                    keep, fd = fd, None
                    return keep, data, None
        return None, None, bad
    finally:
        if fd is not None:
            os.close(fd)
        os.close(dfd)


def untrusted_reason(path: Path) -> str | None:
    """None when ``path`` may be loaded, else why not (owner, mode, missing or different digest, ...)."""
    fd, _, reason = _inspect(path)
    if fd is not None:
        os.close(fd)
    return reason


def record_digest(lib: Path, data: bytes) -> None:
    """Write ``<lib>.sha256`` (mode 0600, atomically) for the library content ``data`` this user just built."""
    target = digest_path(lib)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"{hashlib.sha256(data).hexdigest()}  {lib.name}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)
    os.replace(tmp, target)


def open_library(path: Path) -> ctypes.CDLL:
    """Load ``path`` after checking the file it loads; :class:`KernelTrustError` (naming the file and the reason)
    when a check fails: nothing of a failing file runs."""
    path = Path(path)
    fd, data, reason = _inspect(path)
    if fd is None:
        raise KernelTrustError(f"kernel library {path} was not loaded: {reason}")
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, hashlib.sha256(data).hexdigest())
    if key in _LOADED:
        os.close(fd)
        return _LOADED[key]
    try:
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
    except OSError as e:
        os.close(fd)
        raise KernelBuildError(f"kernel library {path} cannot be loaded: {e}") from None
    _PINNED.append(fd)
    _LOADED[key] = lib
    return lib


def symbol(lib: ctypes.CDLL, name: str, path: Any) -> Any:
    """``lib.<name>``, or a :class:`KernelBuildError` naming the library and the symbol (a stale or foreign build)."""
    try:
        return getattr(lib, name)
    except AttributeError:
        raise KernelBuildError(f"kernel library {path} has no symbol {name!r} (not a build of this omnilab's "
                               "source); delete it to rebuild") from None
