"""Issue 45, item 5: ``--help`` at 80 columns shows every option name whole, and no
doubled percent sign."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from producer.cli import cli


def _commands(cmd: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, [*path, name])
    else:
        yield path, cmd


COMMANDS = list(_commands(get_command(cli), []))


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help_at_80_columns_names_every_option_whole(path: list[str], cmd: Any) -> None:
    res = CliRunner().invoke(cli, [*path, "--help"], env={"COLUMNS": "80", "LINES": "24"})
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    missing = [o for p in cmd.params for o in p.opts if o.startswith("--")
               and o not in res.output]
    assert not missing, f"cut at 80 columns: {missing}\n{res.output}"
    assert "…" not in res.output, res.output
    assert "%%" not in res.output, res.output


def test_enqueue_help_quality_example_has_one_percent_sign() -> None:
    res = CliRunner().invoke(cli, ["enqueue", "--help"], env={"COLUMNS": "200"})
    assert "near_empty=1%," in res.output, res.output
