"""How each omnilab kernel is chosen: one environment variable per kernel, resolved once per process.

Modes (:data:`KERNEL_MODES`): ``auto`` (the kernel for the CPU's widest ISA if a C++ compiler builds it, else
torch with a warning that says why), ``omnilab`` / ``omnilab-avx512`` / ``omnilab-avx2`` (that kernel, or an
error), ``torch``. :func:`resolve_kernel` applies these rules; a :class:`KernelSlot` holds a module's choice
(resolved on first use, forgotten by ``reset``, switched for a block by ``use``).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import warnings
from pathlib import Path
from typing import Any, Callable

from omnilab import settings
from omnilab.errors import ConfigError
from omnilab.hardware import cpu_flags
from omnilab.kernels.build import KernelBuildError, build_library, select_isa
from omnilab.kernels.trust import open_library, symbol

KERNEL_MODES = ("auto", "omnilab", "omnilab-avx512", "omnilab-avx2", "torch")


def kernel_isa(var: str, mode: str, flags: frozenset[str] | set[str]) -> tuple[str | None, str]:
    """``(isa, reason)`` for a kernel mode of :data:`KERNEL_MODES` other than ``torch``: the CPU's widest ISA
    for ``auto`` / ``omnilab``, the named one for ``omnilab-avx512`` / ``omnilab-avx2``. ``None`` (use torch)
    only for ``auto`` on a CPU with neither; an explicit mode the CPU cannot meet raises ``RuntimeError``
    naming ``var``."""
    isa, reason = select_isa(flags)
    if mode in ("omnilab-avx512", "omnilab-avx2"):
        wanted = mode.split("-", 1)[1]
        if isa is None or (wanted == "avx512" and isa != "avx512"):
            raise RuntimeError(f"{var}={mode} needs a CPU with {wanted}; {reason}")
        return wanted, f"{var}={mode}"
    if isa is None and mode == "omnilab":
        raise RuntimeError(f"{var}=omnilab: the kernel needs avx512f or avx2 + fma; {reason}")
    return isa, reason


def resolve_kernel(var: str, what: str, name: str, loader: Callable[[Path], Any], torch_note: str,
                   env: str | None = None, flags: frozenset[str] | None = None) -> tuple[Any, str, str]:
    """Resolve the kernel choice variable ``var`` (one of :data:`KERNEL_MODES`; ``env`` replaces its value) for
    the ``name`` kernels: ``(lib, reason, source)``, ``lib = loader(built library)`` or ``None`` for torch.

    ``source`` is ``"auto"`` or ``"env"``. A torch result's reason ends with ``torch_note``; a kernel's reason
    is the ISA's (the caller adds what the kernel does). An unknown mode raises ``ConfigError`` (a ``ValueError``)
    naming the variable, its value and the accepted ones; an explicit ``omnilab*`` mode that cannot be met raises
    ``RuntimeError``; ``auto`` falls back to torch, with a ``RuntimeWarning`` when the build fails."""
    text = (settings.raw(var) or "") if env is None else env
    raw = text.strip().lower() or "auto"
    if raw not in KERNEL_MODES:
        raise ConfigError(f"{var}={text!r} is not a {what} mode; accepted: {', '.join(KERNEL_MODES)}")
    source = "auto" if raw == "auto" else "env"
    if raw == "torch":
        return None, f"{var}=torch", source
    if flags is None:
        flags = cpu_flags()
    isa, isa_reason = kernel_isa(var, raw, flags)
    if isa is None:
        return None, f"{isa_reason}: {torch_note}", source
    try:
        lib = loader(build_library(name, isa))
    except (KernelBuildError, OSError) as e:
        if raw != "auto":
            raise RuntimeError(f"{var}={raw}: {e}") from e
        reason = f"omnilab {what} kernel unavailable ({e}); {torch_note}"
        warnings.warn(reason, RuntimeWarning, stacklevel=5)  # the caller of gemv_choice() etc.
        return None, reason, source
    return lib, (f"{var}={raw}: {isa_reason}" if source == "env" else isa_reason), source


class KernelSlot:
    """This process's choice for one kernel. ``resolve(env=None)`` returns ``(choice, lib)`` (a frozen choice
    dataclass with a ``source`` field, and the loaded library or ``None`` for torch)."""

    __slots__ = ("_resolve", "choice", "lib")

    def __init__(self, resolve: Callable[..., tuple[Any, Any]]):
        self._resolve = resolve
        self.choice: Any = None
        self.lib: Any = None

    def get(self) -> Any:
        """The choice (resolved, and the kernel built, on first use)."""
        if self.choice is None:
            self.choice, self.lib = self._resolve()
        return self.choice

    def loaded(self) -> Any:
        """The library of the current choice, or ``None`` for torch (resolves first if needed)."""
        if self.choice is None:
            self.get()
        return self.lib

    def reset(self) -> None:
        """Forget the choice (tests; a changed environment variable takes effect on the next use)."""
        self.choice = self.lib = None

    @contextlib.contextmanager
    def use(self, mode: str):
        """Within the block this process uses ``mode`` (one of :data:`KERNEL_MODES`), e.g. to time torch
        against the kernel on one loaded model. Not for worker processes (set the environment variable before
        they start) and not thread-safe against concurrent model calls."""
        saved = (self.choice, self.lib)
        choice, lib = self._resolve(env=mode)
        self.choice, self.lib = dataclasses.replace(choice, source="argument"), lib
        try:
            yield self.choice
        finally:
            self.choice, self.lib = saved


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Which implementation a one-library kernel module uses, and why (:mod:`~omnilab.kernels.norm`,
    :mod:`~omnilab.kernels.attention`): ``label`` says the kernel's ``kernel_note`` or torch's ``torch_note``."""

    mode: str             # "omnilab" | "torch"
    isa: str | None       # "avx512" | "avx2" | None
    library: str | None   # path of the compiled kernel
    reason: str
    source: str           # "auto" | "env" | "argument" (KernelSlot.use)
    kernel_note: str = ""
    torch_note: str = ""

    @property
    def label(self) -> str:
        return f"omnilab-{self.isa} ({self.kernel_note})" if self.mode == "omnilab" else f"torch ({self.torch_note})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label!r}, source={self.source!r})"


class KernelLib:
    """A built library with one entry point ``fn`` (its ``argtypes``, returning int) and ``<prefix>_isa``."""

    def __init__(self, path: Path, entry: str, isa_symbol: str, argtypes: list):
        self.path = Path(path)
        self.lib = open_library(self.path)  # checked first (kernels/trust.py); a missing symbol: KernelBuildError
        self.fn = symbol(self.lib, entry, path)
        self.fn.argtypes = argtypes
        self.fn.restype = ctypes.c_int
        isa = symbol(self.lib, isa_symbol, path)
        isa.restype = ctypes.c_char_p
        self.isa = isa().decode()


def resolve_simple(var: str, what: str, name: str, loader: Callable[[Path], KernelLib], kernel_note: str,
                   torch_note: str, env: str | None = None, flags: frozenset[str] | None = None
                   ) -> tuple[KernelChoice, Any]:
    """:func:`resolve_kernel` for a :class:`KernelLib` kernel built from ``<name>.cpp``: ``(choice, lib or None)``."""
    lib, reason, source = resolve_kernel(var, what, name, loader, torch_note, env, flags)
    if lib is None:
        return KernelChoice("torch", None, None, reason, source, kernel_note, torch_note), None
    return KernelChoice("omnilab", lib.isa, str(lib.path), f"{reason}; {kernel_note}", source, kernel_note,
                        torch_note), lib
