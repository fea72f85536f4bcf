"""Compile omnilab's C++ kernels once per machine kind and cache the shared library.

``build_library(isa)`` compiles ``<name>.cpp`` next to this file with the system C++ compiler (``$CXX``,
else ``g++``, else ``c++``) into ``$OMNILAB_CACHE/kernels/<name>-<isa>-<hash>.so``; the hash covers the
source, the flags and the compiler's version line, so an edited source or another compiler gets a new
file. A file lock makes concurrent first uses (a notebook and vLLM's worker processes) build it once.
The folder is this user's and private (0700); a cached file is used only when :mod:`omnilab.kernels.trust` vouches
for it (owner, mode, the sha256 recorded beside it at build time), else a fresh private file is compiled over it
(a folder of another user is refused with the reason). Plain Python + subprocess: no torch extension machinery
(a build takes about a second).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from omnilab.hardware import select_isa  # noqa: F401  (the ISA rule, plain: `omnilab plan` says it without torch)
from omnilab.kernels.trust import KernelBuildError, check_dir, record_digest, untrusted_reason
from omnilab.paths import cache_dir, file_lock, private_dir

SOURCE_DIR = Path(__file__).resolve().parent
ISA_FLAGS = {"avx512": ("-mavx512f", "-mfma"), "avx2": ("-mavx2", "-mfma")}
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp")
LINK_FLAGS = {"snake": ("-lmvec",), "attn": ("-lmvec",), "stack": ("-lmvec",)}  # per source: glibc's vector math (sinf, expf)
# per source: the decode attention rounds each RoPE op as torch does, the stack its SwiGLU (no a * b + c contracted
# into one FMA)
SOURCE_FLAGS = {"attn": ("-ffp-contract=off",), "stack": ("-ffp-contract=off",)}
# per source and ISA: the quantized GEMV's avx512 build uses vpdpbusd, vpdpwssd and 16-bit shifts (qgemv.py picks it
# only with avx512_vnni and avx512bw); both builds widen fp16 scales (F16C, on every AVX2 CPU)
SOURCE_ISA_FLAGS = {("qgemv", "avx512"): ("-mavx512vnni", "-mavx512bw"), ("qgemv", "avx2"): ("-mf16c",)}


def find_compiler() -> str | None:
    """``$CXX`` if set (must exist), else the first of g++ / c++ on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return shutil.which("g++") or shutil.which("c++")


def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"cannot run the C++ compiler {cxx!r}: {e}") from e
    return (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else cxx


def library_path(name: str, isa: str, cxx: str, cache: Path | None = None) -> Path:
    """Where the library for this source, ISA and compiler lives (whether built or not)."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown ISA {isa!r}; accepted: {', '.join(ISA_FLAGS)}")
    src = (SOURCE_DIR / f"{name}.cpp").read_bytes()
    for inc in re.findall(rb'#include "([^"]+)"', src):  # local headers (simd.h): an edit there rebuilds too
        src += (SOURCE_DIR / inc.decode()).read_bytes()
    flags = (COMMON_FLAGS + ISA_FLAGS[isa] + SOURCE_ISA_FLAGS.get((name, isa), ()) + SOURCE_FLAGS.get(name, ())
             + LINK_FLAGS.get(name, ()))
    digest = hashlib.sha256(src + " ".join(flags).encode() + _compiler_version(cxx).encode()).hexdigest()[:12]
    return (cache or cache_dir() / "kernels") / f"{name}-{isa}-{digest}.so"


def build_library(name: str, isa: str, *, cxx: str | None = None, cache: Path | None = None) -> Path:
    """Return the path of the compiled ``name`` kernels for ``isa``, compiling them if not cached (or if the cached
    file fails the checks of :func:`omnilab.kernels.trust.untrusted_reason`: then a fresh private file replaces it)."""
    cxx = cxx or find_compiler()
    if cxx is None:
        wanted = os.environ.get("CXX") or "g++ or c++"
        raise KernelBuildError(f"no C++ compiler found ({wanted} on PATH); install g++ or set CXX")
    out = library_path(name, isa, cxx, cache)
    check_dir(private_dir(out.parent))
    if untrusted_reason(out) is None:
        return out
    with file_lock(out.parent / ".lock"):
        reason = untrusted_reason(out)
        if reason is None:  # another process built it while we waited
            return out
        if out.exists() and not reason.startswith("no digest recorded"):
            warnings.warn(f"kernel library {out} not used ({reason}); compiling a fresh one", RuntimeWarning,
                          stacklevel=2)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [cxx, *COMMON_FLAGS, *ISA_FLAGS[isa], *SOURCE_ISA_FLAGS.get((name, isa), ()),
               *SOURCE_FLAGS.get(name, ()), str(SOURCE_DIR / f"{name}.cpp"), *LINK_FLAGS.get(name, ()), "-o", tmp]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                raise KernelBuildError(f"compiling {name}.cpp failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
            os.chmod(tmp, 0o700)  # the linker creates its output with the umask's mode
            record_digest(out, Path(tmp).read_bytes())  # the digest first: a reader never pairs it with an old file
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out
