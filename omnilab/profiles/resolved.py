"""``Resolved``: a decided value, why it has that value, and who decided it (the unit of every deploy profile field).

A leaf of ``omnilab.profiles``: imports nothing from omnilab.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Resolved(Generic[T]):
    """A decided value, why it has that value, and who decided (auto, env NAME, argument, preset, file)."""
    value: T
    reason: str
    source: str = "auto"

    def __repr__(self) -> str:
        return f"{self.value!r} ({self.source})"
