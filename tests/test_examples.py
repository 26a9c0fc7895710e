"""The recipes of docs/recipes.md run on the simulator in one command, every sample verified."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_every_recipe_runs_in_one_command() -> None:
    res = subprocess.run([sys.executable, "-m", "examples.run", "all"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    out = res.stdout
    assert "verify: expected 48 (prompts 12, samples 48), missing 0, duplicates 0, ok True" in out
    assert out.count("check: ok") == 3
    assert "best_of_n: ok, tool_use: ok, extraction: ok" in out
