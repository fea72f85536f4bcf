"""What the suite needs installed, and what a missing piece does to a run (docs/testing.md#missing-dependencies).

A test that cannot run because a package (vllm, ray, playwright, ...) or a program (chromium, a C++ compiler) is
missing skips on a developer's machine, saying what to install; under ``CI=true`` it fails instead, so a green CI run
means the install works. A skip for a hardware reason (no AVX-512, one CPU) stays a skip everywhere.
"""
from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest

MISSING = "missing dependency"


def strict() -> bool:
    """Whether a missing dependency fails the run (``CI`` set to a true value, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def missing(what: str, install: str) -> None:
    """Skip (locally) or fail (under ``CI=true``) because ``what`` is not installed; ``install`` says how to get it."""
    msg = f"{MISSING}: {what} ({install})"
    if strict():
        pytest.fail(f"{msg}; CI=true: a missing dependency fails the run", pytrace=False)
    pytest.skip(msg)


def need(module: str, install: str = "./scripts/setup.sh installs it") -> ModuleType:
    """Import ``module`` for a test -> the module; missing: ``missing(...)``. Usable at module level."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing(f"cannot import {module!r}: {e}", install)
        raise  # unreachable: missing() skips or fails


def need_program(name: str, install: str, path: str | None = None) -> str:
    """The path of program ``name`` (or of ``path`` when given); missing: ``missing(...)``."""
    found = path if path and os.access(path, os.X_OK) else (None if path else shutil.which(name))
    if not found:
        missing(f"no {name} at {path}" if path else f"no {name} on PATH", install)
    return found
