"""Shared by the kernel tests: the ISAs this CPU runs, each kernel's library per ISA, a fresh choice per test."""
from __future__ import annotations

import pytest

from omnilab.hardware import cpu_flags
from omnilab.kernels.build import build_library

FLAGS = cpu_flags()
ISAS = [i for i, need in (("avx512", {"avx512f"}), ("avx2", {"avx2", "fma"})) if need <= FLAGS]


def skip_without_isa() -> None:
    """Skip the calling test module on a CPU that runs no build of the kernels."""
    if not ISAS:
        pytest.skip("CPU has neither avx512f nor avx2 + fma: the kernel does not apply here", allow_module_level=True)


def fixtures(module, name: str):
    """``(lib, fresh_choice)`` fixtures for the kernel module ``module`` (built from ``<name>.cpp``): ``lib`` is
    its library for each ISA this CPU runs; ``fresh_choice`` resolves the process-wide choice anew in each test
    (the environment variable unset) and leaves no choice behind."""

    @pytest.fixture(scope="module", params=ISAS)
    def lib(request):
        return module._Lib(build_library(name, request.param))

    @pytest.fixture
    def fresh_choice(monkeypatch):
        monkeypatch.delenv(module.ENV, raising=False)
        module.reset()
        yield monkeypatch
        module.reset()

    return lib, fresh_choice
