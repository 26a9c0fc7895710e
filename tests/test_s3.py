"""The store on a real S3 endpoint (moto's server over HTTP) and a job through it end to end."""

from __future__ import annotations

import hashlib
import io
import os
import time

import orjson
import pyarrow.parquet as pq
import pytest
from pyarrow import fs

from config.settings import S3Settings
from tests.conftest import run_producer, write_prompts
from tests.test_sink import cli, digest_of, wait_job
from workers.dataset.jobs import decode_rows, result_key
from workers.dataset.manifest import manifest_key, success_key
from workers.dataset.store import LocalStore, S3Store, open_store
from workers.errors import StoreError

MIB = 2**20


class Broken(io.RawIOBase):
    """A body that yields ``fail_after`` bytes and then fails, like a dying data source."""

    def __init__(self, size: int, fail_after: int, stall_s: float = 0.0) -> None:
        self.left, self.fail_after, self.sent, self.stall_s = size, fail_after, 0, stall_s

    def readable(self) -> bool:
        """It is a readable stream."""
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        """Fill ``buf`` with bytes until the failure point."""
        if self.sent >= self.fail_after:
            time.sleep(self.stall_s)  # the parts read so far go over the wire meanwhile
            raise OSError("source died mid-upload")
        n = min(len(buf), self.left, self.fail_after - self.sent)
        buf[:n] = b"x" * n
        self.left, self.sent = self.left - n, self.sent + n
        return n


def bucket_of(env: dict[str, str]) -> str:
    """The bucket of an ``s3_env`` store URL (s3://bucket/prefix)."""
    return env["FLEET_STORE_URL"].removeprefix("s3://").split("/", 1)[0]


def _small_parts(moto_server) -> S3Settings:
    return S3Settings(
        endpoint_url=moto_server.url,
        region="us-east-1",
        multipart_threshold_bytes=5 * MIB,
        multipart_chunk_bytes=5 * MIB,
    )


def test_s3_store_round_trip_with_multipart(s3_env, moto_server):
    bucket = bucket_of(s3_env)
    store = S3Store(bucket, "p", _small_parts(moto_server))
    store.put("a/one.json", b"{}")
    big = os.urandom(12 * MIB)
    store.put_stream("a/big.bin", io.BytesIO(big))
    assert store.get("a/one.json") == b"{}" and store.exists("a/big.bin")
    assert list(store.list("a/")) == ["a/big.bin", "a/one.json"]
    head = moto_server.client().head_object(Bucket=bucket, Key="p/a/big.bin")
    assert head["ETag"].strip('"').endswith("-3")  # three parts: a real multipart upload
    copy = io.BytesIO()
    store.get_into("a/big.bin", copy)
    assert hashlib.sha256(copy.getvalue()).digest() == hashlib.sha256(big).digest()
    store.delete("a/one.json")
    assert not store.exists("a/one.json") and list(store.list("a/")) == ["a/big.bin"]


def test_interrupted_upload_leaves_no_visible_object(s3_env, moto_server, tmp_path):
    bucket = bucket_of(s3_env)
    store = S3Store(bucket, "p", _small_parts(moto_server))
    calls: list[str] = []
    store._client.meta.events.register(  # watch what goes over the wire
        "after-call.s3.*", lambda model, **_: calls.append(model.name)
    )
    with pytest.raises((OSError, StoreError)):
        store.put_stream("data/part-00000.parquet", Broken(17 * MIB, 12 * MIB, stall_s=1.0))
    assert calls[0] == "CreateMultipartUpload" and calls[-1] == "AbortMultipartUpload"
    assert calls.count("UploadPart") >= 1  # it died midway, with parts already sent
    with pytest.raises((OSError, StoreError)):
        store.put_stream("data/small.json", Broken(MIB, fail_after=MIB // 2))
    client = moto_server.client()
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")  # aborted
    local = LocalStore(tmp_path / "store")
    with pytest.raises((OSError, StoreError)):
        local.put_stream("data/part-00000.parquet", Broken(3 * MIB, fail_after=MIB))
    assert list(local.list("")) == [] and not list((tmp_path / "store").rglob("*.tmp*"))
    assert not [p for p in (tmp_path / "store").rglob("*") if p.is_file()]


def _objects(env: dict[str, str], job: str) -> dict[str, bytes]:
    store = open_store(
        env["FLEET_STORE_URL"], S3Settings(endpoint_url=env["FLEET_S3_ENDPOINT_URL"])
    )
    keys = [
        k
        for k in store.list(f"jobs/{job}/")
        if "/data/" in k or k.endswith(("manifest.json", "_SUCCESS"))
    ]
    return {k: store.get(k) for k in keys}


def _s3fs(env: dict[str, str]) -> fs.S3FileSystem:
    return fs.S3FileSystem(
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
        endpoint_override=env["FLEET_S3_ENDPOINT_URL"],
        scheme="http",
    )


def test_job_through_s3_sink_export_and_reuse(s3_env, make_workers, tmp_path, r):
    s3_only = {k: v for k, v in s3_env.items() if k.startswith(("FLEET_S3", "AWS_"))}
    make_workers([0], FLEET_STORE_URL=s3_env["FLEET_STORE_URL"], **s3_only)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 120)
    res = run_producer(
        s3_env,
        "enqueue",
        str(prompts),
        "--job",
        "s3job",
        "--batch-size",
        "20",
        "--max-new-tokens",
        "32",
    )
    assert res.returncode == 0, res.stderr
    wait_job(s3_env, "s3job")
    report = orjson.loads(cli(s3_env, "verify", "--job", "s3job", "--json").stdout)
    assert report["ok"] and report["rows"] == 120

    # The last batch asked for the job's own sink run (default shard size); "done" does not
    # wait for it. Let it commit first: run after the first --local run below, it writes
    # other shards, and the second --local run then rightly writes a new version.
    deadline = time.monotonic() + 60
    while success_key("s3job") not in _objects(s3_env, "s3job"):
        assert time.monotonic() < deadline, "the job's own sink run never committed"
        time.sleep(0.2)
    env = {**s3_env, "FLEET_SHARD_ROWS": "50"}
    assert cli(env, "sink", "--job", "s3job", "--local").returncode == 0
    first = _objects(s3_env, "s3job")
    assert cli(env, "sink", "--job", "s3job", "--local").returncode == 0
    assert _objects(s3_env, "s3job") == first  # byte-identical shards, manifest, _SUCCESS
    manifest = orjson.loads(first[manifest_key("s3job")])
    assert [s["rows"] for s in manifest["shards"]] == [60, 60] and manifest["complete"]
    assert success_key("s3job") in first

    url = cli(s3_env, "dataset-path", "--job", "s3job").stdout.strip()
    assert url == f"s3://{bucket_of(s3_env)}/runs/{manifest['data_prefix']}"
    table = pq.read_table(url.removeprefix("s3://"), filesystem=_s3fs(s3_env))  # one-line load
    assert table.num_rows == 120 and table.column("index").to_pylist() == list(range(120))
    assert table.column("id").to_pylist() == [f"p{i}" for i in range(120)]
    assert set(table.column("status").to_pylist()) == {"ok"}
    assert None not in table.column("completion").to_pylist()

    # openai-batch writes one line per prompt, and says so (not "rows": issue 35).
    wrote = {"parquet": "wrote 120 rows", "jsonl": "wrote 120 rows",
             "openai-batch": "wrote 120 lines (one per prompt)"}
    for fmt, line in wrote.items():
        out = tmp_path / f"out.{fmt}"
        res = cli(s3_env, "export", "--job", "s3job", "--format", fmt, "--out", str(out))
        assert res.returncode == 0 and line in res.stderr, res.stderr
        assert "ok 120 + errors 0 = 120 rows" in res.stderr, res.stderr
    assert pq.read_table(tmp_path / "out.parquet").equals(table)
    assert [
        orjson.loads(x)["custom_id"]
        for x in (tmp_path / "out.openai-batch").read_bytes().splitlines()
    ] == table.column("id").to_pylist()

    # Reuse: 70 old prompts and 30 new ones; only the new ones reach the engine.
    newer = tmp_path / "newer.jsonl"
    newer.write_bytes(
        b"".join(prompts.read_bytes().splitlines(keepends=True)[:70])
        + write_prompts(tmp_path / "fresh.jsonl", 30, start=500).read_bytes()
    )
    res = run_producer(
        s3_env,
        "enqueue",
        str(newer),
        "--job",
        "again",
        "--batch-size",
        "20",
        "--max-new-tokens",
        "32",
        "--reuse-from",
        "s3job",
    )
    assert res.returncode == 0, res.stderr
    assert "reused 70 rows" in res.stderr and "enqueued 2, already done 3" in res.stderr
    wait_job(s3_env, "again")
    assert orjson.loads(cli(s3_env, "verify", "--job", "again", "--json").stdout)["ok"]
    store = open_store(
        s3_env["FLEET_STORE_URL"], S3Settings(endpoint_url=s3_env["FLEET_S3_ENDPOINT_URL"])
    )
    old = {x["index"]: x for b in range(6) for x in decode_rows(store.get(result_key("s3job", b)))}
    rows = [x for b in range(5) for x in decode_rows(store.get(result_key("again", b)))]
    assert [x["index"] for x in rows] == list(range(100))
    assert [x.get("reused_from") for x in rows] == ["s3job"] * 70 + [None] * 30
    # Every row records its engine's launch digest: the worker's profile, as on disk.
    assert {x["launch_digest"] for x in old.values()} == {digest_of("qwen36-27b")}
    assert all(
        x["completion"] == old[x["index"]]["completion"]
        and x["latency_s"] == old[x["index"]]["latency_s"]
        for x in rows[:70]
    )
    assert cli(s3_env, "sink", "--job", "again", "--local").returncode == 0
    counts = orjson.loads(store.get(manifest_key("again")))["counts"]
    assert counts["reused"] == 70 and sum(counts.values()) - counts["reused"] == 100
