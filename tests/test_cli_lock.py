"""The lock check ``make test`` runs: requirements.lock must satisfy pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

CHECK = ROOT / "tools" / "check_lock.py"


def _check(pyproject: Path, lock: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK), str(pyproject), str(lock)],
                          capture_output=True, text=True, timeout=60)


def _copy(tmp_path: Path, old: str = "", new: str = "", lock_old: str = "",
          lock_new: str = "") -> tuple[Path, Path]:
    pyproject, lock = tmp_path / "pyproject.toml", tmp_path / "requirements.lock"
    text = (ROOT / "pyproject.toml").read_text()
    assert old in text
    pyproject.write_text(text.replace(old, new, 1))
    lock_text = (ROOT / "requirements.lock").read_text()
    assert lock_old in lock_text
    lock.write_text(lock_text.replace(lock_old, lock_new, 1))
    return pyproject, lock


def test_the_committed_lock_agrees_with_pyproject():
    res = _check(ROOT / "pyproject.toml", ROOT / "requirements.lock")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    lock = (ROOT / "requirements.lock").read_text()
    assert "--hash=sha256:" in lock and "\ncelery==" in lock and "\nmoto==" in lock


def test_a_raised_requirement_fails_the_check(tmp_path):
    res = _check(*_copy(tmp_path, '"kombu>=5.7.0,<5.8"', '"kombu>=5.8,<5.9"'))
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        "requirements.lock disagrees with pyproject.toml: kombu<5.9,>=5.8: the lock pins "
        f"kombu=={_pinned('kombu')} (run make lock)"]


def test_a_new_dependency_missing_from_the_lock_fails_the_check(tmp_path):
    res = _check(*_copy(tmp_path, '"pytest>=8.0",', '"pytest>=8.0",\n    "tabulate>=0.9",'))
    assert res.returncode == 1 and "tabulate>=0.9: not in the lock" in res.stderr


def test_a_package_dropped_from_the_lock_fails_the_check(tmp_path):
    res = _check(*_copy(tmp_path, lock_old="\norjson==", lock_new="\n# orjson=="))
    assert res.returncode == 1 and "orjson>=3.10: not in the lock" in res.stderr


def _pinned(name: str) -> str:
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.startswith(f"{name}=="):
            return line.split("==")[1].split()[0]
    raise AssertionError(f"{name} is not pinned")
