"""Column mapping: data sets whose columns are not named prompt / messages / id."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from producer.readers import ReadOptions, read_rows
from tests.conftest import run_producer
from workers.dataset.jobs import load_batch_input
from workers.dataset.store import open_store
from workers.errors import InputError

OPTS = ReadOptions(prompt_column="question", messages_column="dialog", id_column="qid")


def test_jsonl_columns_are_mapped_and_bad_rows_quarantined_with_a_reason(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [
        {"qid": "q0", "question": "Why?"},
        {"qid": "q1", "dialog": [{"role": "user", "content": "Hi"}]},
        {"qid": "q2", "prompt": "a column under its default name is not the mapped one"},
        {"qid": "q3", "question": 42},
        {"qid": 4, "dialog": "not a list"},
    ]))
    rows = list(read_rows(src, OPTS))
    assert rows[0] == {"index": 0, "id": "q0", "prompt": "Why?"}
    assert rows[1] == {"index": 1, "id": "q1", "messages": [{"role": "user", "content": "Hi"}]}
    assert rows[2]["error"] == "line 3: no 'question' or 'dialog'"
    assert rows[3]["error"] == "line 4: 'question' must be a non-empty string"
    assert rows[4] == {"index": 4, "id": "4", "error": "line 5: 'dialog' must be a non-empty list"}


def test_parquet_columns_are_mapped_and_nulls_quarantined(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"qid": ["a", "b", "c"], "question": ["hello", None, "x"],
                             "other": [1, 2, 3]}), path)
    rows = list(read_rows(path, OPTS))
    assert rows[0] == {"index": 0, "id": "a", "prompt": "hello"}
    assert rows[1]["error"] == "row 1: no 'question' or 'dialog'"
    assert rows[2]["id"] == "c"


def test_a_parquet_column_of_the_wrong_type_quarantines_its_rows(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"question": [1, 2]}), path)
    rows = list(read_rows(path, OPTS))
    assert [r["error"] for r in rows] == ["row 0: 'question' must be a non-empty string",
                                          "row 1: 'question' must be a non-empty string"]


def test_a_parquet_file_without_the_mapped_columns_is_refused(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a"]}), path)
    with pytest.raises(InputError, match=r"in\.parquet: no 'question', 'dialog' or 'body'"):
        list(read_rows(path, OPTS))


def test_enqueue_maps_columns_and_quarantines(fleet_env, tmp_path: Path, r):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"k": "x1", "q": "one"}\n{"k": "x2", "q": ["not", "text"]}\n')
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "cols", "--prompt-column", "q",
                       "--id-column", "k")
    assert res.returncode == 0, res.stderr
    assert "quarantined 1" in res.stderr and "'q' must be a non-empty string" in res.stderr
    rows = load_batch_input(open_store(fleet_env["FLEET_STORE_URL"]), "cols", 0)
    assert [(x.id, x.prompt, x.error) for x in rows] == [
        ("x1", "one", None), ("x2", None, "line 2: 'q' must be a non-empty string")]
