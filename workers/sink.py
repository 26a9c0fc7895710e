"""The sink: aggregate a job's per-batch results into Parquet shards with a manifest.

Run it with ``celery -A workers worker -Q sink`` (task ``fleet.sink_job``), or in-process with
``python -m producer sink --job NAME --local``. Batches are read in order; rows go into a
shard sorted by index; a shard is cut at the first batch boundary where its file reaches
``shard_target_bytes`` or it holds ``shard_rows`` rows, so a batch is in exactly one shard.
Each shard is written to a local temporary file, hashed and uploaded with a managed
(multipart) transfer, then the manifest is written, and ``_SUCCESS`` last, only when
``verify`` passes. Nothing depends on the clock or on the order results arrived in, so a
second run writes the same bytes (see workers/manifest.py for the layout).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import redis
import redis.asyncio as aioredis
from celery import Task, current_app, shared_task

from config.settings import Settings, load_settings
from producer.verify import verify_job
from workers import jobstate
from workers.celery_app import SINK_QUEUE
from workers.errors import FleetError, StoreError
from workers.jobs import (
    JobSpec,
    batch_of_result_key,
    decode_rows,
    load_spec,
    result_key,
    results_prefix,
)
from workers.lease import LeaseKeeper, index_key
from workers.manifest import (
    SCHEMA,
    ShardInfo,
    Tally,
    build_manifest,
    data_prefix,
    encode_manifest,
    load_manifest,
    manifest_key,
    shard_key,
    shards_digest,
    success_key,
    to_record,
)
from workers.retry import RetryPolicy
from workers.store import RetryingStore, Store, open_store, store_policy

log = logging.getLogger(__name__)

SINK_TASK = "fleet.sink_job"
PREFETCH = 8
LOCK_TTL_S = 3600
AUTO_DEDUP_S = 300
T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class ShardLimits:
    """When a shard is cut and how rows are grouped inside it."""

    target_bytes: int = 256 * 2**20
    rows: int = 1_000_000
    row_group_bytes: int = 64 * 2**20

    @classmethod
    def from_settings(cls, s: Settings) -> ShardLimits:
        """The limits configured by FLEET_SHARD_*."""
        return cls(s.shard_target_bytes, s.shard_rows, s.shard_row_group_bytes)


class ShardWriter:
    """One shard in a local file: buffered batches become row groups, in index order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = pa.OSFile(str(path), "wb")
        self._writer = pq.ParquetWriter(self._file, SCHEMA, compression="zstd",
                                        compression_level=3)
        self._buf: list[dict[str, Any]] = []
        self.buffered_bytes = 0
        self.rows = 0
        self.batches: list[int] = []
        self.indices: list[int] = []

    def __repr__(self) -> str:
        return f"<ShardWriter {self.path.name} rows={self.rows} bytes={self.written_bytes}>"

    @property
    def written_bytes(self) -> int:
        """Bytes of row groups already in the file."""
        return int(self._file.tell())

    def add(self, batch: int, rows: list[dict[str, Any]], raw_bytes: int) -> None:
        """Buffer one batch's rows (already sorted by index)."""
        self._buf += [to_record(r) for r in rows]
        self.buffered_bytes += raw_bytes
        self.rows += len(rows)
        self.batches.append(batch)
        self.indices += [rows[0]["index"], rows[-1]["index"]]

    def flush(self) -> None:
        """Write the buffered rows as one row group."""
        if self._buf:
            table = pa.Table.from_pylist(self._buf, schema=SCHEMA)
            self._writer.write_table(table, row_group_size=len(self._buf))
        self._buf, self.buffered_bytes = [], 0

    def close(self) -> None:
        """Flush and finish the file (footer included)."""
        self.flush()
        self._writer.close()
        self._file.close()


def prefetched(fn: Callable[[T], U], items: Iterable[T], window: int = PREFETCH) -> Iterator[U]:
    """``map(fn, items)`` in order, with up to ``window`` calls running ahead in threads."""
    with ThreadPoolExecutor(max_workers=window) as pool:
        pending: deque[Future[U]] = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _sha256_and_size(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with path.open("rb") as fh:
        while chunk := fh.read(8 * 2**20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _finish(store: Store, job: str, n: int, shard: ShardWriter) -> ShardInfo:
    """Close a shard, hash it and upload it; return its manifest entry."""
    shard.close()
    sha, size = _sha256_and_size(shard.path)
    key = shard_key(job, n)
    with shard.path.open("rb") as fh:
        store.put_stream(key, fh)
    shard.path.unlink()
    log.info("sink %s: wrote %s (%d rows, %d bytes)", job, key, shard.rows, size)
    return ShardInfo(key=key, rows=shard.rows, first_index=min(shard.indices),
                     last_index=max(shard.indices), first_batch=shard.batches[0],
                     last_batch=shard.batches[-1], bytes=size, sha256=sha)


def stored_batches(store: Store, job: str) -> list[int]:
    """Batches whose result object is in the store, in order."""
    return sorted(b for k in store.list(results_prefix(job))
                  if (b := batch_of_result_key(k)) is not None)


def write_shards(store: Store, spec: JobSpec, limits: ShardLimits, tmp: Path
                 ) -> tuple[list[ShardInfo], Tally]:
    """Write every stored batch into shards; return the shard entries and the row counts."""

    def fetch(batch: int) -> tuple[int, bytes]:
        return batch, store.get(result_key(spec.name, batch))

    shards: list[ShardInfo] = []
    tally, cur = Tally(), None
    for batch, raw in prefetched(fetch, stored_batches(store, spec.name)):
        rows = sorted(decode_rows(raw), key=lambda x: int(x["index"]))
        if not rows:
            continue
        for row in rows:
            tally.add(row)
        cur = cur or ShardWriter(tmp / f"part-{len(shards):05d}.parquet")
        cur.add(batch, rows, len(raw))
        if cur.buffered_bytes >= limits.row_group_bytes:
            cur.flush()
        if cur.rows >= limits.rows or cur.written_bytes >= limits.target_bytes:
            shards.append(_finish(store, spec.name, len(shards), cur))
            cur = None
    if cur is not None:
        shards.append(_finish(store, spec.name, len(shards), cur))
    return shards, tally


def _drop_stale(store: Store, job: str, keep: set[str]) -> None:
    """Remove shards a previous run wrote that this data set no longer has."""
    for key in store.list(data_prefix(job)):
        if key not in keep:
            store.delete(key)


def _finished_at(previous: dict[str, Any] | None, shards: list[ShardInfo]) -> float:
    """Keep the earlier time when the shards are unchanged, so a re-run changes no byte."""
    if previous and previous.get("digest") == shards_digest(shards):
        return float(previous["finished_at_unix"])
    return time.time()


def aggregate(store: Store, job: str, limits: ShardLimits,
              policy: RetryPolicy | None = None) -> dict[str, Any]:
    """Write the job's shards, manifest and (if verify passes) ``_SUCCESS``; return a summary."""
    store = RetryingStore(store, policy or RetryPolicy(max_attempts=10))
    spec = load_spec(store, job)
    report = verify_job(store, spec)
    store.delete(success_key(job))
    with tempfile.TemporaryDirectory(prefix="fleet-sink-") as tmp:
        shards, tally = write_shards(store, spec, limits, Path(tmp))
    _drop_stale(store, job, {s.key for s in shards})
    manifest = build_manifest(spec, shards, tally, report,
                              _finished_at(load_manifest(store, job), shards))
    data = encode_manifest(manifest)
    store.put(manifest_key(job), data)
    if manifest["complete"]:
        store.put(success_key(job), hashlib.sha256(data).hexdigest().encode() + b"\n")
    log.info("sink %s: %d rows in %d shards, complete=%s", job, manifest["totals"]["rows"],
             len(shards), manifest["complete"])
    return {"job": job, "complete": manifest["complete"], "manifest": manifest_key(job),
            "shards": len(shards), "rows": manifest["totals"]["rows"],
            "bytes": manifest["totals"]["bytes"], "counts": manifest["counts"],
            "missing": report["missing"], "duplicates": report["duplicates"]}


# --- Celery side -------------------------------------------------------------------------


def state_key(job: str) -> str:
    """Redis hash with the state of the job's latest sink run (for ``sink --wait``)."""
    return f"{jobstate.Keys(job).job}:sink"


def set_state(r: redis.Redis, job: str, state: str, request: str | None,
              **extra: Any) -> None:
    """Record the sink state of a job: queued, running, done or failed."""
    fields = {"state": state, "request": request or "", "at": time.time(),
              **{k: orjson.dumps(v) for k, v in extra.items()}}
    r.hset(state_key(job), mapping=fields)


def _take_lock(r: redis.Redis, job: str, owner: str) -> bool:
    """One sink run per job; a redelivered task (same id, its worker died) takes its lock back."""
    lock = f"{state_key(job)}:lock"
    if r.set(lock, owner, nx=True, ex=LOCK_TTL_S):
        return True
    return (r.get(lock) or b"").decode() == owner


def _aggregate_and_record(r: redis.Redis, job: str, request: str | None) -> dict[str, Any]:
    settings = load_settings()
    store = open_store(settings.store_url, settings.s3)
    set_state(r, job, "running", request)
    summary = aggregate(store, job, ShardLimits.from_settings(settings), store_policy(settings))
    set_state(r, job, "done", request, summary=summary)
    return summary


@shared_task(name=SINK_TASK, bind=True, max_retries=5)
def sink_job(self: Task, job: str, request: str | None = None) -> dict[str, Any]:
    """Aggregate ``job`` into Parquet shards, manifest and ``_SUCCESS``."""
    r = redis.Redis.from_url(load_settings().redis_url.get_secret_value())
    owner = str(self.request.id or request or "local")
    try:
        if not _take_lock(r, job, owner):
            # Another run of this job is writing: come back when it is done.
            raise self.retry(countdown=30, max_retries=LOCK_TTL_S // 30)
        try:
            return _aggregate_and_record(r, job, request)
        except StoreError as exc:  # transient: a few spaced retries
            if self.request.retries < (self.max_retries or 0):
                set_state(r, job, "retrying", request, error=str(exc))
                raise self.retry(exc=exc, countdown=15) from exc
            set_state(r, job, "failed", request, error=str(exc))
            raise
        except Exception as exc:  # JobError and anything unexpected: say so, then fail
            set_state(r, job, "failed", request, error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            r.delete(f"{state_key(job)}:lock")
    finally:
        r.close()


def start_lease_keeper(app: Any) -> LeaseKeeper:
    """For a sink-only worker (no engine, so no runtime): renew the leases of its tasks."""
    settings = load_settings()
    client = redis.Redis.from_url(settings.redis_url.get_secret_value())
    keeper = LeaseKeeper(client, index_key(app), settings.lease_renew_s)
    keeper.start()
    return keeper


def _auto_key(job: str) -> str:
    return f"{state_key(job)}:auto"


def trigger_if_complete(r: redis.Redis, app: Any, spec: JobSpec, settings: Settings) -> bool:
    """Enqueue ``fleet.sink_job`` once when every batch of ``spec`` is done (deduplicated)."""
    if not settings.sink_auto or r.scard(jobstate.Keys(spec.name).done) < spec.n_batches:
        return False
    if not r.set(_auto_key(spec.name), 1, nx=True, ex=AUTO_DEDUP_S):
        return False
    set_state(r, spec.name, "queued", None)
    app.send_task(SINK_TASK, args=[spec.name], queue=SINK_QUEUE)
    return True


async def trigger_when_done(r: aioredis.Redis, spec: JobSpec, settings: Settings) -> bool:
    """From a batch task: enqueue ``fleet.sink_job`` once when the job's last batch is done."""
    if not settings.sink_auto or await r.scard(jobstate.Keys(spec.name).done) < spec.n_batches:
        return False
    if not await r.set(_auto_key(spec.name), 1, nx=True, ex=AUTO_DEDUP_S):
        return False
    await r.hset(state_key(spec.name), mapping={"state": "queued", "request": "",
                                                "at": time.time()})
    await asyncio.to_thread(current_app.send_task, SINK_TASK, args=[spec.name],
                            queue=SINK_QUEUE)
    log.info("job %s: last batch done, sink enqueued", spec.name)
    return True


def request_sink(r: redis.Redis, app: Any, job: str) -> str:
    """Enqueue a sink run of ``job`` for the sink worker; return its request id."""
    request = uuid.uuid4().hex
    set_state(r, job, "queued", request)
    app.send_task(SINK_TASK, args=[job, request], queue=SINK_QUEUE)
    return request


def wait_sink(r: redis.Redis, job: str, request: str, timeout_s: float,
              poll_s: float = 0.5) -> dict[str, Any]:
    """Wait until the sink run ``request`` is done; return its summary (FleetError if not)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = {k.decode(): v for k, v in r.hgetall(state_key(job)).items()}
        if raw.get("request", b"").decode() == request:
            state = raw["state"].decode()
            if state == "done":
                return dict(orjson.loads(raw["summary"]))
            if state == "failed":
                raise FleetError(f"sink of {job} failed: {orjson.loads(raw['error'])}")
        time.sleep(poll_s)
    raise FleetError(f"sink of {job} not done after {timeout_s:.0f} s; is a sink worker "
                     "running (celery -A workers worker -Q sink)?")
