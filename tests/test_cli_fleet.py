"""The ``fleet`` console script (a fresh install of the package) and ``fleet tune`` on typer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PLAN = ["plan", "--profile", "qwen36-27b-baseline", "--gpus", "7", "--prompts", "913786",
        "--avg-output-tokens", "2490", "--gpu-price-per-hour", "4", "--gpu-memory-mib", "183359"]


# One xdist worker runs this module, so its module fixture starts once (make test).
pytestmark = pytest.mark.xdist_group("installed-package")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The package installed from the source tree into a fresh folder (not editable), its
    dependencies taken from this environment; commands run outside the source tree."""
    target, src = tmp_path_factory.mktemp("install"), tmp_path_factory.mktemp("src")
    # From a copy: setuptools builds in the source folder (build/), never in the checkout.
    for name in ("producer", "workers", "config"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(src)], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env["PYTHONPATH"] = str(target)
    return target, env


def _fleet(installed: tuple[Path, dict[str, str]], *args: str,
           **env: str) -> subprocess.CompletedProcess[str]:
    target, base = installed
    return subprocess.run([str(target / "bin" / "fleet"), *args], env={**base, **env},
                          cwd=target.parent, capture_output=True, text=True, timeout=120)


def _commands(help_text: str) -> list[str]:
    block = help_text.split("Commands")[1]
    return [line.split()[1] for line in block.splitlines()
            if line.startswith("│ ") and line.split()[1][0].isalpha()
            and not line.startswith("│   ")]


def test_the_console_script_has_the_commands_of_python_m_producer(installed):
    res = _fleet(installed, "--help")
    assert res.returncode == 0, res.stderr
    module = subprocess.run([sys.executable, "-m", "producer", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert _commands(res.stdout) == _commands(module.stdout)
    assert {"enqueue", "status", "verify", "tune"} <= set(_commands(res.stdout))


def test_shell_completion_through_typer(installed):
    got = _fleet(installed, _FLEET_COMPLETE="complete_bash", COMP_WORDS="fleet tune pl",
                 COMP_CWORD="2")
    assert got.stdout.split() == ["plan"]
    got = _fleet(installed, _FLEET_COMPLETE="complete_bash", COMP_WORDS="fleet enq",
                 COMP_CWORD="1")
    assert got.stdout.split() == ["enqueue"]


def test_tune_plan_shows_the_tuners_choice_beside_the_profile(installed):
    table = _fleet(installed, "tune", *PLAN)
    assert table.returncode == 0, table.stderr
    assert "given profile" in table.stdout and "tuner would launch" in table.stdout
    assert "ETA (hours)" in table.stdout and "--max-mamba-cache-size" in table.stdout
    res = subprocess.run([sys.executable, "-m", "workers.tune", *PLAN, "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    tuned = plan["tuner_alternative"]
    assert tuned["running_per_gpu"] > plan["running_per_gpu"]
    assert tuned["eta_hours"] < plan["eta_hours"] and tuned["cost"] < plan["cost"]
    assert set(tuned["flag_changes"]) == {"max-mamba-cache-size", "max-running-requests"}
    assert "mamba-ssm-dtype" not in tuned["flag_changes"]  # lossy only with --allow-lossy


def test_tune_errors_are_one_line_with_the_named_exit_code(installed, tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    res = _fleet(installed, "tune", "diagnose", "--snapshot", str(empty))
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("tune diagnose: ") and "Traceback" not in res.stderr
    res = _fleet(installed, "tune", "plan", "--profile", "no-such-profile", "--gpus", "1",
                 "--prompts", "1", "--avg-output-tokens", "1")
    assert res.returncode == 2 and res.stderr.startswith("tune plan: "), res.stderr
