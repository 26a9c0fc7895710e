"""The README and docs/ stay true: links resolve, the commands and flags they show exist, the
FLEET_* settings they name exist, and nothing cites a document the repository does not hold.

Quick and offline: the CLI is read in-process from its typer app (no Redis, no cluster).
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer.main

from deploy.compose_gen import setting_names
from producer.cli import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
# `fleet CMD ...` (also `.venv/bin/fleet`) and `python -m producer CMD ...`
COMMAND = re.compile(r"(?:(?<=[\s'\"(;&|])|^)(?:\S*/)?(?:fleet|python -m producer)\s+"
                     r"([a-z][\w-]*(?:\s+[a-z][\w-]*)?)(.*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
SETTING = re.compile(r"\bFLEET_[A-Z0-9_]*[A-Z0-9]\b")


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    text = FENCE.sub("", path.read_text())
    return frozenset(_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M))


def _links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_relative_link_resolves(doc: Path) -> None:
    """Each relative link names a file of the repository, and an anchor a heading of it."""
    broken = []
    for target in _links(doc):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{_doc_id(doc)}: broken links {broken}"


def _shown_commands(text: str) -> list[tuple[str, str]]:
    """(command words, rest of the line) of every fleet / producer command in a code block."""
    found = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
            for match in COMMAND.finditer(line):
                found.append((match.group(1), re.split(r"&&|\|\||;|\|", match.group(2))[0]))
    return found


def _is_group(command: Any) -> bool:
    # typer may ship its own copy of click: test the shape, not the class
    return isinstance(getattr(command, "commands", None), dict)


def _resolve(words: str) -> Any:
    """The command object for ``words`` (``status`` or ``tune plan``), None if there is none."""
    command: Any = typer.main.get_command(cli)
    for word in words.split():
        if not _is_group(command):
            break
        command = command.commands.get(word)
        if command is None:
            return None
    return None if _is_group(command) else command


def _flags(command: Any) -> set[str]:
    names = {"--help"}
    for param in command.params:
        names.update(o for o in [*param.opts, *param.secondary_opts] if o.startswith("--"))
    return names


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_command_and_flag_shown_exists(doc: Path) -> None:
    """Every ``fleet X`` / ``python -m producer X`` in a code block names a real command, and
    every ``--flag`` on that line is one of that command's options."""
    wrong = _wrong_commands(doc.read_text())
    assert not wrong, f"{_doc_id(doc)}: {wrong}"


def _wrong_commands(text: str) -> list[str]:
    wrong = []
    for words, rest in _shown_commands(text):
        command = _resolve(words)
        if command is None:
            wrong.append(f"fleet {words}: no such command")
            continue
        unknown = set(FLAG.findall(rest)) - _flags(command)
        if unknown:
            wrong.append(f"fleet {words}: no option {sorted(unknown)}")
    return wrong


def test_the_docs_show_commands() -> None:
    """The command check above has something to check (its pattern still matches the docs)."""
    shown = {words.split()[0] for doc in DOCS for words, _ in _shown_commands(doc.read_text())}
    assert {"enqueue", "status", "verify", "tune", "export", "sink"} <= shown


def test_a_wrong_command_or_flag_is_caught() -> None:
    """The resolver refuses what does not exist (so the check above can fail)."""
    assert _resolve("status") is not None and _resolve("tune plan") is not None
    assert _resolve("no-such-command") is None and _resolve("tune") is None
    status = _resolve("status")
    assert status is not None and "--json" in _flags(status)
    assert "--no-such-flag" not in _flags(status)
    block = ("```\nfleet status --job a --jbo b   # typo\nfleet stauts --job a\n"
             "alias fleet='docker compose exec sink fleet'\n"
             "x | .venv/bin/fleet tune plan --gpus 7 \\\n    --no-such-flag 1\n```\n")
    assert _wrong_commands(block) == ["fleet status: no option ['--jbo']",
                                      "fleet stauts: no such command",
                                      "fleet tune plan: no option ['--no-such-flag']"]


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_fleet_setting_named_exists(doc: Path) -> None:
    """Every ``FLEET_*`` name in the docs is a setting of config/settings.py."""
    known = set(setting_names())
    named = set(SETTING.findall(doc.read_text()))
    assert named - known == set(), f"{_doc_id(doc)} names unknown settings"


# Citations of notes that live outside the repository. ``workload.md`` and ``sglang.md`` are
# also docs/ pages: they may be named as ``docs/NAME.md`` or linked relatively from docs/.
FOREIGN = re.compile(
    r"design-notes|facts/|peers\.md|celery\.md|shared notes|\bshared/|nvml-h200x2/"
    r"|(?<!docs/)(?<!\]\()(?<!\[)\b(?:workload|sglang)\.md"
    r"|§(?!\d+\]\(#)"  # a section sign is only allowed as a link to a heading of the same page
)


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    paths = [ROOT / n for n in names if n and n != "tests/test_docs.py"]
    return [p for p in paths if p.is_file() and p.suffix not in {".png", ".gz", ".parquet"}]


def test_no_citation_of_documents_the_repository_does_not_hold() -> None:
    """Code, profiles, tests, fixtures and docs cite upstream sources or docs/ pages only."""
    hits = []
    for path in _tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if FOREIGN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_the_citation_pattern_catches_what_it_must() -> None:
    """The pattern flags the old citations and spares the repository's own pages."""
    for bad in ("(design-notes §1)", "shared/facts/workload.md", "see workload.md",
                "(workload.md: ~2,490 tokens)", "facts/celery.md §5", "the §3.1 table", "peers.md",
                "fixtures/nvml-h200x2/README.md"):
        assert FOREIGN.search(bad), bad
    for good in ("docs/workload.md", "[capacity](capacity.md)", "[sglang.md](sglang.md)",
                 "[§6](#6-failure-modes-and-recovery)"):
        assert not FOREIGN.search(good), good


# A statement of the supported SGLang range: on a line that says "support" (or what `.[gpu]`
# installs / pins), two releases joined as a range ("A to B", "A or B", ...), or the pip floor.
RELEASE = r"0\.\d+\.\d+(?:\.post\d+)?"
RANGE_LINE = re.compile(r"support|pins that range|adds sglang|allows", re.I)
RANGE = re.compile(rf"({RELEASE})`?\s+(?:to|through|or|and|-)\s+`?({RELEASE})")
PIP_FLOOR = re.compile(rf"sglang>=({RELEASE})")


def _range_statements(text: str) -> list[tuple[str, str, str]]:
    """(line, first, last) of each range statement; the pip floor's last is ``*``."""
    out = []
    for line in text.splitlines():
        out += [(line.strip(), floor, "*") for floor in PIP_FLOOR.findall(line)]
        if RANGE_LINE.search(line):
            out += [(line.strip(), a, b) for a, b in RANGE.findall(line)]
    return out


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "pyproject.toml"], ids=_doc_id)
def test_every_page_states_the_supported_range_of_the_code(doc: Path) -> None:
    from workers.engine.versions import NEWEST, OLDEST

    for line, first, last in _range_statements(doc.read_text()):
        assert first == OLDEST and last in (NEWEST, "*"), (
            f"{_doc_id(doc)} states the supported SGLang range as {first}..{last} ({line!r}); "
            f"the code supports {OLDEST} to {NEWEST} (workers/engine/versions.py)")


def test_the_range_check_catches_a_page_that_disagrees() -> None:
    from workers.engine.versions import NEWEST

    for wrong in ("pip install -e '.[gpu]'   # adds sglang (0.5.10.post1 or 0.5.11)",
                  "Supported SGLang: `0.5.10.post1` and `0.5.11` (`.[gpu]` pins that range)"):
        (_, first, last), = _range_statements(wrong)
        assert (first, last) == ("0.5.10.post1", "0.5.11") and last != NEWEST
    assert _range_statements("gpu = [\"sglang>=0.5.9,<0.6\"]") == [
        ("gpu = [\"sglang>=0.5.9,<0.6\"]", "0.5.9", "*")]
    assert _range_statements("Sources are SGLang 0.5.10.post1 and 0.5.11 as published") == []


def test_python_floor_matches_the_lock() -> None:
    """The lock is built for CPython 3.11 (Makefile ``lock``): pyproject must not claim 3.10."""
    text = (ROOT / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.11"' in text
    assert "--python-version 3.11" in (ROOT / "Makefile").read_text()


def test_the_enqueue_flags_table_is_the_command_s_flags():
    """docs/sglang.md lists every flag of fleet enqueue, as --help shows it (one declaration:
    the command's parameters)."""
    from producer.enqueue_cmd import flags_table

    docs = (ROOT / "docs" / "sglang.md").read_text()
    rows = flags_table()
    start = docs.index(rows[0])
    assert docs[start:].splitlines()[:len(rows) + 1] == [*rows, ""]
