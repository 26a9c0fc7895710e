"""The build context leaves out data, reports and every .env file (the image may be pushed)."""

from __future__ import annotations

import re

from tests.conftest import ROOT


def _regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as Docker reads it (moby/patternmatcher: filepath.Match plus
    ``**``); a pattern that names a folder leaves out everything under it."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "(/.*)?")


def excluded(path: str) -> bool:
    """Whether ``path`` (relative to the repository root) stays out of the build context."""
    verdict = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if _regex(line.lstrip("!").strip("/")).fullmatch(path):
            verdict = not negate
    return verdict


def test_data_reports_and_env_files_stay_out_of_the_image():
    for path in ("data/prompts.jsonl", "data/regen.parquet", "reports/regen/report.md",
                 ".env", ".env.prod", ".env.local", "fleet-data/jobs/x/job.json",
                 "logs/engine-gpu0.log", "certs/redis.key", "workers/__pycache__/x.pyc"):
        assert excluded(path), path
    for path in ("workers/engine/lifecycle.py", "config/profiles/qwen36-27b.toml", "pyproject.toml",
                 "requirements.lock", "deploy/compose_gen.py", "Dockerfile"):
        assert not excluded(path), path
