"""verify and the manifest say one thing: disjoint buckets, a duplicate counted once, a row
that is not its batch's (index range, staged id) reported, never counted."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from tests.test_sink import cli, default_fail, fake_result, local_root, make_job, prompt_rows
from workers.dataset.jobs import PromptRow, decode_rows, encode_rows, load_batch_input, result_key
from workers.dataset.manifest import committed_prefix, load_manifest
from workers.dataset.sink import ShardLimits, aggregate
from workers.dataset.store import LocalStore
from workers.dataset.verify import verify_job

BUCKETS = ("ok", "truncated", "failed", "quarantined")


@pytest.fixture()
def store(tmp_path: Path) -> LocalStore:
    """An empty local store."""
    return LocalStore(tmp_path / "store")


def test_verify_and_manifest_count_quarantined_apart_from_failed(store):
    rows = prompt_rows(40)
    rows[3] = PromptRow(index=3, id="p3", error="line 4: no 'prompt' or 'messages'")
    spec = make_job(store, "q", rows, batch_size=10)
    report = verify_job(store, spec)
    summary = aggregate(store, "q", ShardLimits())
    manifest = load_manifest(store, "q")
    assert {k: v for k, v in report.items() if k != "quality"} == manifest["verify"]
    assert report["quality"] == manifest["quality"]
    assert report["quarantined"] == summary["counts"]["quarantined"] == 1
    engine_failed = sum(default_fail(i) for i in range(40) if i != 3)
    assert report["failed"] == summary["counts"]["failed"] == engine_failed  # not row 3
    assert report["counts"] == manifest["counts"]
    assert sum(report["counts"][b] for b in BUCKETS) == report["rows"] == 40


def test_a_duplicate_row_is_counted_once_and_reported(store):
    spec = make_job(store, "dup", prompt_rows(30), batch_size=10)
    key = result_key("dup", 1)
    got = decode_rows(store.get(key))
    store.put(key, encode_rows([*got, got[4]], compress=False))  # index 14 twice
    report = verify_job(store, spec)
    assert report["duplicates"] == 1 and report["unique"] == 30 and report["rows"] == 31
    assert sum(report["counts"][b] for b in BUCKETS) == 30
    assert not report["ok"] and "index 14 appears twice" in report["problems"][0]
    summary = aggregate(store, "dup", ShardLimits())
    assert summary["duplicates"] == 1 and not summary["complete"]
    table = pq.read_table(store.root / committed_prefix(store, "dup", allow_incomplete=True))
    assert sorted(table.column("index").to_pylist()) == list(range(30))  # one row per prompt


def test_a_row_outside_its_batch_or_with_another_id_is_reported(store):
    spec = make_job(store, "mis", prompt_rows(30), batch_size=10)
    stray = fake_result(spec, 2, load_batch_input(store, "mis", 0)[5])  # batch 0's row in 2
    key = result_key("mis", 2)
    got = decode_rows(store.get(key))
    got[0] = {**got[0], "id": "someone-else"}
    store.put(key, encode_rows([*got, stray], compress=False))
    report = verify_job(store, spec)
    assert report["misplaced"] == 2 and report["duplicates"] == 0 and not report["ok"]
    assert report["unique"] == 29 and report["missing"] == 1  # index 20 lost its own row
    assert aggregate(store, "mis", ShardLimits())["misplaced"] == 2


def test_verify_command_shows_the_same_buckets(fleet_env, r):
    store = LocalStore(local_root(fleet_env))
    rows = prompt_rows(20)
    rows[0] = PromptRow(index=0, id="p0", error="line 1: no 'prompt' or 'messages'")
    make_job(store, "vc", rows, batch_size=10)
    res = cli(fleet_env, "verify", "--job", "vc", "--json")
    report = orjson.loads(res.stdout)
    engine_failed = sum(default_fail(i) for i in range(1, 20))
    # Every row there (not exit 1), but 3 of 20 failed or quarantined and every 7th cut at
    # max_tokens: the quality gates' own code.
    gates = report["quality"]["gates_failed"]
    assert report["ok"] and gates == ["truncated", "failed_or_quarantined"]
    assert res.returncode == 5 and (report["quarantined"], report["failed"]) == (1, engine_failed)
    assert "quarantined" in cli(fleet_env, "verify", "--job", "vc").stdout
