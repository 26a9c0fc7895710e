"""Fail when pyproject.toml and requirements.lock disagree (``make test`` runs it first).

Every requirement of the base dependencies and of the ``dev`` extra (the lock's scope) must
be pinned in the lock at a version its specifier accepts. Offline and deterministic: it never
resolves anything, so a new release upstream does not fail it; a changed pyproject.toml that
the lock no longer satisfies does. Fix a failure with ``make lock``.

Usage: ``python tools/check_lock.py [PYPROJECT] [LOCK]``; exit 0 when they agree, else 1 with
one line per disagreement.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s\\;]+)", re.MULTILINE)
EXTRAS = ("dev",)


def locked_versions(lock_text: str) -> dict[str, Version]:
    """Name (canonical) -> pinned version of every ``name==version`` line of a lock file."""
    return {canonicalize_name(m.group(1)): Version(m.group(2)) for m in PIN.finditer(lock_text)}


def requirements(pyproject: dict) -> list[Requirement]:
    """The base dependencies and the locked extras' requirements."""
    project = pyproject["project"]
    extras = project.get("optional-dependencies", {})
    raw = [*project.get("dependencies", []), *(r for e in EXTRAS for r in extras.get(e, []))]
    return [Requirement(r) for r in raw]


def disagreements(pyproject: dict, lock_text: str) -> list[str]:
    """One line per requirement the lock does not satisfy."""
    pins = locked_versions(lock_text)
    problems = []
    for req in requirements(pyproject):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None:
            problems.append(f"{req}: not in the lock")
        elif not req.specifier.contains(pinned, prereleases=True):
            problems.append(f"{req}: the lock pins {req.name}=={pinned}")
    return problems


def main(argv: list[str]) -> int:
    """Compare the two files; print what disagrees."""
    pyproject_path = Path(argv[0]) if argv else ROOT / "pyproject.toml"
    lock_path = Path(argv[1]) if len(argv) > 1 else ROOT / "requirements.lock"
    pyproject = tomllib.loads(pyproject_path.read_text())
    problems = disagreements(pyproject, lock_path.read_text())
    for line in problems:
        print(f"{lock_path.name} disagrees with {pyproject_path.name}: {line} (run make lock)",
              file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
