"""The quality of the rows: measured by the sink and verify, gated, with a code of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.test_sink import cli, local_root, make_job, prompt_rows
from workers.dataset.jobs import PromptRow, decode_rows, encode_rows, result_key
from workers.dataset.manifest import load_manifest
from workers.dataset.quality import QualityTally
from workers.dataset.quality_gates import evaluate, parse_quality, thresholds
from workers.dataset.quality_options import QualityOptions
from workers.dataset.sink import ShardLimits, aggregate
from workers.dataset.store import LocalStore
from workers.dataset.verify import verify_job
from workers.errors import InputError


def _row(i: int, completion: str | None, tokens: int = 40, **kw: Any) -> dict[str, Any]:
    return {"index": i, "id": f"r{i}", "status": "ok", "finish_reason": "stop",
            "completion": completion, "completion_tokens": tokens, "prompt": "p", **kw}


def test_near_empty_rows_are_counted_with_examples_and_percentiles():
    t = QualityTally()
    for i in range(100):
        t.add(_row(i, "  " if i < 87 else f"a long answer number {i}", 3 if i < 87 else 400))
    q = t.report()
    near = q["figures"]["near_empty"]
    assert (near["count"], near["of"], near["share"]) == (87, 100, 0.87)
    assert near["examples"] == ["r0", "r1", "r2", "r3", "r4"]
    assert q["completion_tokens"]["p50"] == 3 and 390 <= q["completion_tokens"]["p99"] <= 400
    failed = evaluate(q, thresholds(None))
    assert [g["gate"] for g in failed] == ["near_empty"]
    assert failed[0]["threshold"] == 0.01 and failed[0]["examples"][0] == "r0"


def test_reasoning_split_off_leaves_a_short_answer_near_empty():
    t = QualityTally(QualityOptions(thinking=lambda row: True))
    t.add(_row(0, "ok", 500, reasoning="x" * 2000))  # 500 tokens, almost all reasoning
    t.add(_row(1, "<think>pondering</think>" + "y" * 400, 120))  # markers left in
    t.add(_row(2, "z" * 400, 100, reasoning="why"))
    f = t.report()["figures"]
    assert f["near_empty"]["examples"] == ["r0"]
    assert f["no_reasoning"]["examples"] == ["r1"] and f["markers"]["examples"] == ["r1"]


def test_identical_answers_across_prompts_and_all_equal_samples():
    t = QualityTally(QualityOptions(sampled=True))
    for i in range(4):
        for s in range(2):  # prompt 0 and 1: both samples the same text; 2, 3 differ
            text = "same answer for all" if i < 2 else f"answer {i} sample {s}"
            t.add(_row(i, text, sample=s))
    f = t.report()["figures"]
    assert f["identical"]["count"] == 4 and f["identical"]["of"] == 8
    assert f["same_samples"]["count"] == 2 and f["same_samples"]["of"] == 4


def test_truncated_failed_and_quarantined_shares():
    t = QualityTally()
    t.add(_row(0, "cut " * 50, finish_reason="length"))
    t.add({"index": 1, "id": "r1", "status": "failed", "error": "engine", "prompt": "p"})
    t.add({"index": 2, "id": "r2", "status": "failed", "error": "line 3: no 'prompt'"})
    t.add(_row(3, "fine answer " * 10))
    f = t.report()["figures"]
    assert (f["truncated"]["count"], f["failed"]["count"], f["quarantined"]["count"]) == (1, 1, 1)
    assert f["failed_or_quarantined"]["share"] == 0.5


def test_quality_values_parse_as_shares_or_percentages():
    assert parse_quality(["near_empty=2%", "truncated=0.1", "near-empty-tokens=4"]) == {
        "near_empty": 0.02, "truncated": 0.1, "near_empty_tokens": 4}
    for bad in (["nosuch=1"], ["near_empty=abc"], ["near_empty=150%"], ["truncated"]):
        with pytest.raises(InputError):
            parse_quality(bad)


@pytest.fixture()
def store(tmp_path: Path) -> LocalStore:
    """An empty local store."""
    return LocalStore(tmp_path / "store")


def _empty_answers(store: LocalStore, job: str, batches: int) -> None:
    """Rewrite every stored result as the seed's disaster: a few tokens, finishing with stop."""
    for b in range(batches):
        rows = decode_rows(store.get(result_key(job, b)))
        rows = [{**r, "status": "ok", "error": None, "finish_reason": "stop",
                 "completion": " ", "completion_tokens": 3} for r in rows]
        store.put(result_key(job, b), encode_rows(rows, compress=False))


def test_sink_commits_the_data_set_and_its_manifest_names_the_failed_gates(store):
    spec = make_job(store, "seed", prompt_rows(40), batch_size=10, fail=lambda i: False)
    _empty_answers(store, "seed", spec.n_batches)
    summary = aggregate(store, "seed", ShardLimits())
    manifest = load_manifest(store, "seed")
    assert summary["complete"] and manifest["complete"]  # nothing lost
    quality = manifest["quality"]
    assert "near_empty" in quality["gates_failed"] and not quality["ok"]
    assert summary["quality_failed"] == quality["gates_failed"]
    assert verify_job(store, spec)["quality"]["failed"] == quality["failed"]


def test_verify_exits_with_its_own_code_and_names_each_gate(fleet_env, r):
    store = LocalStore(local_root(fleet_env))
    rows = prompt_rows(20)
    rows[0] = PromptRow(index=0, id="p0", error="line 1: no 'prompt' or 'messages'")
    spec = make_job(store, "vq", rows, batch_size=10, fail=lambda i: False)
    _empty_answers(store, "vq", spec.n_batches)
    res = cli(fleet_env, "verify", "--job", "vq", "--json")
    report = orjson.loads(res.stdout)
    assert res.returncode == 5 and report["ok"]
    assert "near_empty" in report["quality"]["gates_failed"]
    res = cli(fleet_env, "verify", "--job", "vq")
    assert res.returncode == 5 and "near_empty 100.0 %" in res.stdout + res.stderr
    assert "e.g. p0" in res.stdout + res.stderr or "e.g. p1" in res.stdout + res.stderr
    res = cli(fleet_env, "verify", "--job", "vq", "--quality", "near_empty=100%",
              "--quality", "identical=1", "--quality", "failed_or_quarantined=10%")
    assert res.returncode == 0, res.stdout + res.stderr
    res = cli(fleet_env, "verify", "--job", "vq", "--quality", "bogus=1")
    assert res.returncode == 2 and "unknown gate 'bogus'" in res.stderr


def test_report_plots_the_quality_of_the_committed_data_set(store, r, tmp_path):
    from producer.report import build_report

    spec = make_job(store, "rq", prompt_rows(30), batch_size=10, fail=lambda i: False)
    _empty_answers(store, "rq", spec.n_batches)
    aggregate(store, "rq", ShardLimits())
    summary = build_report(r, store, spec, tmp_path / "rep")
    assert "near_empty" in summary["quality"]["gates_failed"]
    assert (tmp_path / "rep" / "quality.png").stat().st_size > 1000
    assert "gate(s) failed: near_empty" in (tmp_path / "rep" / "report.md").read_text()


def test_the_sinks_table_path_measures_what_the_row_path_does():
    import pyarrow as pa

    from workers.dataset.manifest import SCHEMA, to_record
    from workers.dataset.quality_table import add_table

    rows = []
    for i in range(300):
        kind = i % 10
        completion = {0: " ", 1: "<think>x</think>fine answer here", 2: "dup answer text",
                      3: None}.get(kind, f"answer {i} " * (i % 7 + 1))
        rows.append({"index": i, "id": f"r{i}", "prompt": None if kind == 5 else "p",
                     "messages": [{"role": "user", "content": "q"}] if i % 2 else None,
                     "status": "failed" if kind == 3 else "ok", "error": "x" if kind == 3 else None,
                     "finish_reason": "length" if kind == 4 else "stop", "completion": completion,
                     "reasoning": "why " * (i % 5) if kind != 6 else None,
                     "completion_tokens": (i * 7) % 900, "profile": "qwen36-27b"})
    opts = QualityOptions(near_empty_tokens=10,
                          thinking=lambda row: row.get("messages") is not None)
    by_row, by_table = QualityTally(opts), QualityTally(opts)
    for row in rows:
        by_row.add(row)
    for start in (0, 128):  # two row groups
        part = rows[start:start + 128] if start == 0 else rows[128:]
        add_table(by_table, pa.Table.from_pylist([to_record(r) for r in part], schema=SCHEMA))
    a, b = by_row.report(), by_table.report()
    assert {k: v["count"] for k, v in a["figures"].items()} == {
        k: v["count"] for k, v in b["figures"].items()}
    assert (a["rows"], a["answered"], a["thinking_rows"], a["histogram"]) == (
        b["rows"], b["answered"], b["thinking_rows"], b["histogram"])
    assert a["figures"]["identical"]["count"] > 0 and a["figures"]["markers"]["count"] > 0
