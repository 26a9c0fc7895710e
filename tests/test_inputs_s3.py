"""Prompt data sets in S3 (moto's server over HTTP): one object, a prefix of parts, resume."""

from __future__ import annotations

import gzip
import io
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from config.settings import S3Settings
from producer.enqueue import EnqueueReport, stage
from producer.readers import ReadOptions, read_rows
from tests.conftest import run_producer
from workers.dataset.jobs import load_spec
from workers.dataset.store import LocalStore, open_store
from workers.errors import InputError


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


def _parquet(rows: list[dict[str, Any]]) -> bytes:
    buf = io.BytesIO()
    # Small row groups, so the reader seeks between ranged reads.
    pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=7)
    return buf.getvalue()


def _prompts(start: int, n: int) -> list[dict[str, Any]]:
    return [{"id": f"p{i}", "prompt": f"question {i}"} for i in range(start, start + n)]


PARTS = {  # a data set as a writer of parts leaves it, with a marker object beside them
    "part-000.jsonl.gz": gzip.compress(_jsonl(_prompts(0, 12))),
    "part-001.parquet": _parquet(_prompts(12, 30)),
    "part-002.jsonl": _jsonl(_prompts(42, 5)),
    "_SUCCESS": b"",
}


def _bucket(s3_env: dict[str, str]) -> str:
    return s3_env["FLEET_STORE_URL"].removeprefix("s3://").split("/")[0]


def _upload(moto_server, bucket: str, prefix: str, parts: dict[str, bytes]) -> str:
    client = moto_server.client()
    for name, data in parts.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)
    return f"s3://{bucket}/{prefix}"


def test_one_object_reads_as_the_local_file(s3_env, moto_server, tmp_path):
    url = _upload(moto_server, _bucket(s3_env), "one", PARTS)
    local = tmp_path / "part-001.parquet"
    local.write_bytes(PARTS["part-001.parquet"])
    remote = list(read_rows(f"{url}/part-001.parquet", ReadOptions(), S3Settings()))
    assert remote == list(read_rows(local)) and len(remote) == 30
    gz = list(read_rows(f"{url}/part-000.jsonl.gz", ReadOptions(), S3Settings()))
    assert [r["id"] for r in gz] == [f"p{i}" for i in range(12)]


def test_a_prefix_of_parts_stages_like_a_local_folder(s3_env, moto_server, tmp_path):
    url = _upload(moto_server, _bucket(s3_env), "ds", PARTS)
    folder = tmp_path / "ds"
    folder.mkdir()
    for name, data in PARTS.items():
        (folder / name).write_bytes(data)
    fingerprints = []
    for src in (url, f"{url}/", folder):
        report = EnqueueReport(spec=None, created=True)  # type: ignore[arg-type]
        store = LocalStore(tmp_path / f"store{len(fingerprints)}")
        total, n, fp = stage(store, "j", read_rows(src, ReadOptions(), S3Settings()), 10,
                             report, skip_existing=False)
        fingerprints.append((total, n, fp))
    assert fingerprints[0] == fingerprints[1] == fingerprints[2]
    assert fingerprints[0][:2] == (47, 5)
    rows = list(read_rows(url, ReadOptions(), S3Settings()))
    assert [r["index"] for r in rows] == list(range(47))
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(47)]


def test_a_prefix_named_like_a_file_is_read_as_its_parts(s3_env, moto_server):
    url = _upload(moto_server, _bucket(s3_env), "out.parquet", PARTS)
    rows = list(read_rows(url, ReadOptions(), S3Settings()))
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(47)]


def test_missing_objects_and_prefixes_are_one_line(s3_env, moto_server):
    bucket = _bucket(s3_env)
    with pytest.raises(InputError, match=r"^s3://.*/nope\.jsonl: no such object$"):
        read_rows(f"s3://{bucket}/nope.jsonl", ReadOptions(), S3Settings())
    with pytest.raises(InputError, match=r"^s3://.*/empty: no \.jsonl\[\.gz\] or \.parquet parts"):
        read_rows(f"s3://{bucket}/empty", ReadOptions(), S3Settings())


def test_resume_after_a_partial_enqueue_of_a_prefix(s3_env, moto_server, r):
    bucket = _bucket(s3_env)
    broken = {**PARTS, "part-002.jsonl": _jsonl(_prompts(42, 2)) + b'{"prompt": broken\n'}
    url = _upload(moto_server, bucket, "resume", broken)
    res = run_producer(s3_env, "enqueue", url, "--job", "s3in", "--batch-size", "10")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {url}/part-002.jsonl:3: not valid JSON")
    store = open_store(s3_env["FLEET_STORE_URL"], S3Settings())
    # A refused new job leaves nothing (issue 33's refusals: exit 2, one line, nothing staged):
    # no staged batch, no record. The re-run below stages the input again from the start.
    assert list(store.list("jobs/s3in/")) == []

    _upload(moto_server, bucket, "resume", {"part-002.jsonl": PARTS["part-002.jsonl"]})
    res = run_producer(s3_env, "enqueue", url, "--job", "s3in", "--batch-size", "10")
    assert res.returncode == 0, res.stderr
    assert "job s3in created: 47 prompts in 5 batches of 10; enqueued 5" in res.stderr
    spec = load_spec(store, "s3in")
    assert spec.input_path == url and spec.total == 47

    res = run_producer(s3_env, "enqueue", url, "--job", "s3in")
    assert res.returncode == 0, res.stderr
    assert "resumed: 47 prompts in 5 batches of 10; enqueued 0, already done 0, already " \
           "pending 5" in res.stderr
    assert load_spec(store, "s3in").input_fingerprint == spec.input_fingerprint

    _upload(moto_server, bucket, "resume", {"part-003.jsonl": _jsonl(_prompts(47, 1))})
    res = run_producer(s3_env, "enqueue", url, "--job", "s3in")
    assert res.returncode == 3 and "fingerprint mismatch" in res.stderr


def test_fsspec_urls_read_like_local_parts(tmp_path):
    """Other schemes go through fsspec (tested: memory://, fsspec's own filesystem)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for name, data in PARTS.items():
        fs.pipe(f"/fsspec-ds/{name}", data)
    rows = list(read_rows("memory://fsspec-ds", ReadOptions()))
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(47)]
    one = list(read_rows("memory://fsspec-ds/part-001.parquet", ReadOptions()))
    assert [r["id"] for r in one] == [f"p{i}" for i in range(12, 42)]
    with pytest.raises(InputError, match=r"^memory://fsspec-ds/none\.jsonl: no such file$"):
        read_rows("memory://fsspec-ds/none.jsonl", ReadOptions())
    with pytest.raises(InputError, match=r"^nosuchscheme://x: cannot open: "):
        read_rows("nosuchscheme://x", ReadOptions())
