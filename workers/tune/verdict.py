"""A binding constraint and its cause, as diagnose names it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Verdict:
    """A binding constraint and its cause."""

    constraint: str
    cause: str
    notes: list[str] = field(default_factory=list)
