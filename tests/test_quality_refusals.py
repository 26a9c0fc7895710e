"""enqueue's refusals: exit 2, one line, nothing staged; and no request key dropped silently."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from tests.test_sink import cli, local_root
from workers.dataset.jobs import load_batch_input
from workers.dataset.store import LocalStore


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def _nothing_staged(env: dict[str, str], job: str) -> bool:
    """Not an object, nor an empty folder (issue 45, item 3)."""
    return not (local_root(env) / "jobs" / job).exists()


def test_a_prompt_column_typo_is_refused_listing_the_columns(fleet_env, r, tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [{"id": f"a{i}", "question": f"q {i}"}
                                         for i in range(10)])
    res = cli(fleet_env, "enqueue", str(src), "--job", "typo", "--prompt-column", "questoin")
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and "'questoin'" in line and "the rows have: id, question" in line
    assert _nothing_staged(fleet_env, "typo")
    pq.write_table(pa.table({"id": ["a"], "question": ["q"]}), tmp_path / "in.parquet")
    res = cli(fleet_env, "enqueue", str(tmp_path / "in.parquet"), "--job", "typo2",
              "--prompt-column", "questoin")
    assert res.returncode == 2 and "its columns: id, question" in res.stderr
    assert _nothing_staged(fleet_env, "typo2")


def test_a_kept_column_no_row_has_is_refused(fleet_env, r, tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": f"q {i}", "topic": "x"} for i in range(30)])
    res = cli(fleet_env, "enqueue", str(src), "--job", "keep", "--keep-columns", "nosuchcol",
              "--batch-size", "10")
    assert res.returncode == 2 and "no row has the column 'nosuchcol'" in res.stderr
    assert _nothing_staged(fleet_env, "keep")


def test_quarantined_rows_over_the_gate_are_refused_unless_allowed(fleet_env, r, tmp_path):
    env = {**fleet_env, "FLEET_QUALITY": ""}  # the default gates (conftest turns them off)
    rows = [{"prompt": f"q {i}"} if i % 10 else {"promt": "typo"} for i in range(50)]
    src = _jsonl(tmp_path / "in.jsonl", rows)
    res = cli(env, "enqueue", str(src), "--job", "quar", "--batch-size", "10")
    assert res.returncode == 2, res.stderr
    assert "5 of 50 rows (10.0%) would be quarantined" in res.stderr
    assert "--allow-quarantine" in res.stderr and _nothing_staged(env, "quar")
    res = cli(env, "enqueue", str(src), "--job", "quar", "--batch-size", "10",
              "--quality", "failed_or_quarantined=20%")
    assert res.returncode == 0, res.stderr
    res = cli(env, "enqueue", str(src), "--job", "quar2", "--allow-quarantine")
    assert res.returncode == 0, res.stderr
    spec = orjson.loads((local_root(env) / "jobs/quar/job.json").read_bytes())
    assert spec["quality"] == {"failed_or_quarantined": 0.2}


def test_plain_rows_carry_their_request_keys(fleet_env, r, tmp_path):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    src = _jsonl(tmp_path / "in.jsonl", [
        {"id": "t", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
         "tool_choice": "auto", "max_tokens": 7},
        {"id": "j", "prompt": "give json", "json_schema": '{"type": "object"}',
         "temperature": 0.5, "topic": "kept out"},
    ])
    res = cli(fleet_env, "enqueue", str(src), "--job", "keys")
    assert res.returncode == 0, res.stderr
    rows = load_batch_input(LocalStore(local_root(fleet_env)), "keys", 0)
    assert rows[0].params == {"tools": tools, "tool_choice": "auto", "max_tokens": 7}
    assert rows[1].params == {"json_schema": '{"type": "object"}', "temperature": 0.5}
    res = cli(fleet_env, "enqueue", str(_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "raw text", "tools": tools}])), "--job", "keys2")
    assert res.returncode == 2 and "tools" in res.stderr and _nothing_staged(fleet_env, "keys2")
