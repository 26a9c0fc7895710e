"""Store edges: transfer-manager errors, a 403, killed writers' leftovers, durable renames,
objects readable by others."""

from __future__ import annotations

import io
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from config.settings import S3Settings
from producer.exports import export
from tests.s3fixture import AWS_ENV
from tests.test_s3 import bucket_of
from tests.test_sink import make_job, prompt_rows
from workers.dataset.sink import ShardLimits, aggregate
from workers.dataset.store import LocalStore, RetryingStore, S3Store, StoreDenied
from workers.errors import StoreError
from workers.retry import RetryPolicy

SIZE = 64 * 1024


@dataclass
class FakeS3:
    """An HTTP endpoint answering like S3 where it misbehaves: HEAD of ``denied/…`` is a 403
    (a missing key without s3:ListBucket), GET of ``cut/…`` stops halfway through the body."""

    url: str
    calls: Counter[str] = field(default_factory=Counter)

    def settings(self) -> S3Settings:
        """FLEET_S3_* pointing at this endpoint."""
        return S3Settings(endpoint_url=self.url, region="us-east-1")


@pytest.fixture()
def fake_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeS3]:
    """A FakeS3 on a free port, for one test."""
    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    fake = FakeS3(url="")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _headers(self, code: int, length: int) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(length))
            self.send_header("ETag", '"0123456789abcdef"')
            self.send_header("Last-Modified", "Mon, 30 Nov 2026 10:00:00 GMT")
            self.end_headers()

        def do_HEAD(self) -> None:
            fake.calls["HEAD"] += 1
            self._headers(403 if "/denied/" in self.path else 200, 0 if "/denied/" in
                          self.path else SIZE)

        def do_GET(self) -> None:
            fake.calls["GET"] += 1
            self._headers(200, SIZE)
            self.wfile.write(b"x" * (SIZE // 2))  # then the connection drops
            self.wfile.flush()
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield fake
    server.shutdown()
    server.server_close()


def retrying(fake: FakeS3, attempts: int) -> RetryingStore:
    """The fake endpoint behind the fleet's retry wrapper, without waits."""
    return RetryingStore(S3Store("bucket", "p", fake.settings()),
                         RetryPolicy(max_attempts=attempts, base_s=0, max_s=0))


def test_a_403_on_head_is_reported_at_once_not_retried(fake_s3):
    with pytest.raises(StoreDenied, match="access denied .*s3:ListBucket"):
        retrying(fake_s3, 5).exists("denied/key")
    assert fake_s3.calls["HEAD"] == 1


def test_a_cut_download_is_a_store_error_the_fleet_retries(fake_s3):
    with pytest.raises(StoreError, match="cannot read cut/key"):
        retrying(fake_s3, 1).get_into("cut/key", io.BytesIO())
    one_attempt = fake_s3.calls["GET"]
    fake_s3.calls.clear()
    with pytest.raises(StoreError, match="cannot read cut/key"):
        retrying(fake_s3, 3).get_into("cut/key", io.BytesIO())
    assert one_attempt >= 1 and fake_s3.calls["GET"] == 3 * one_attempt


def test_the_sink_aborts_multipart_uploads_a_killed_run_left(s3_env, moto_server, r):
    bucket = bucket_of(s3_env)
    store = S3Store(bucket, "p", S3Settings(endpoint_url=moto_server.url, region="us-east-1"))
    make_job(store, "mp", prompt_rows(20), batch_size=10)
    client = moto_server.client()
    dead = client.create_multipart_upload(Bucket=bucket,
                                          Key="p/jobs/mp/data/v000001-0dead0/part-00000.parquet")
    client.upload_part(Bucket=bucket, Key=dead["Key"], UploadId=dead["UploadId"], PartNumber=1,
                       Body=b"x" * 1024)
    # (Uploads elsewhere in the job are aborted only when a day old; moto reports a fixed
    # 2010 "Initiated" time, so that age rule is tested on the local store's .tmp files.)
    aggregate(store, "mp", ShardLimits())
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_the_sink_removes_temporary_leftovers(tmp_path):
    store = LocalStore(tmp_path / "store")
    make_job(store, "tmp", prompt_rows(20), batch_size=10)
    ours = store.root / "jobs/tmp/data/v000001-0dead0/.tmp-abc"
    old = store.root / "jobs/tmp/results/.tmp-old"
    fresh = store.root / "jobs/tmp/results/.tmp-fresh"
    for p in (ours, old, fresh):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"half an object")
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (day_ago, day_ago))
    aggregate(store, "tmp", ShardLimits())
    assert not ours.exists() and not old.exists() and fresh.exists()


def test_objects_and_exports_are_readable_by_others(tmp_path):
    store = LocalStore(tmp_path / "store")
    make_job(store, "mode", prompt_rows(20), batch_size=10)
    aggregate(store, "mode", ShardLimits())
    files = [p for p in store.root.rglob("*") if p.is_file()]
    assert files and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o644}
    out = tmp_path / "out" / "mode.jsonl"
    export(store, "mode", "jsonl", out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_a_put_fsyncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    synced: list[tuple[str, bool]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        synced.append((path, Path(path).is_dir()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store.put("a/b/obj.json", b"{}")
    folders = [p for p, is_dir in synced if is_dir]
    assert str(store.root / "a/b") in folders  # the rename's folder
    assert str(store.root / "a") in folders  # and the new folder's entry in its parent
    assert synced[0][0].startswith(str(store.root / "a/b/.tmp-"))  # the data first
