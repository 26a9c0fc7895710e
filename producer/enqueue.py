"""Stage a prompt file into the store batch by batch and enqueue what is not done or pending.

Re-running it for the same job is the resume and reconcile command: the store says which
batches are done (their result objects exist), Redis says which are pending, and only the rest
is sent. The input is streamed: a batch is compressed and written on a background thread while
the next one is parsed, and at most a few batches are held in memory.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson
import redis
from celery import Celery

from workers import jobstate
from workers.celery_app import SHARED_QUEUE
from workers.errors import InputError, JobError
from workers.jobs import (
    JobSpec,
    SamplingSpec,
    batch_of_result_key,
    compress_rows,
    decode_rows,
    encode_rows,
    input_key,
    load_spec,
    result_key,
    results_prefix,
    save_spec,
)
from workers.manifest import row_bucket
from workers.store import Store


@dataclass
class EnqueueReport:
    """What one ``enqueue`` run did."""

    spec: JobSpec
    created: bool
    staged: int = 0
    enqueued: int = 0
    already_done: int = 0
    already_pending: int = 0
    bad_rows: list[str] = field(default_factory=list)


def _chunks(rows: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class BatchWriter:
    """Compress and store staged batches on one background thread, in the order given.

    zlib and file or network I/O release the GIL, so a batch is written while the caller parses
    the next on another core. The queue is bounded, so memory stays flat when the store is the
    slower side. The first failed write stops the writes; its exception (a StoreError for the
    store's failures) is raised in the caller's thread by the next :meth:`put` or on leaving
    the ``with`` block, so it ends the command like any other error.
    """

    def __init__(self, store: Store, depth: int = 2) -> None:
        self._store = store
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue(maxsize=depth)
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="stage-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # After a failure the queue is still drained, so a put() never blocks forever.
        while (item := self._queue.get()) is not None:
            if self._error is None:
                key, data = item
                try:
                    self._store.put(key, compress_rows(data))
                except Exception as exc:
                    self._error = exc

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def put(self, key: str, data: bytes) -> None:
        """Queue JSONL ``data`` to be stored compressed under ``key`` (blocks while the queue
        is full); raise the error of an earlier write, if one failed."""
        self._raise_error()
        self._queue.put((key, data))

    def __enter__(self) -> BatchWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Wait for the queued writes; raise a write's error unless the block raised first."""
        self._queue.put(None)
        self._thread.join()
        if exc_type is None:
            self._raise_error()


def _existing_spec(store: Store, job: str) -> JobSpec | None:
    try:
        return load_spec(store, job)
    except JobError:
        return None


def _fingerprint(digest: hashlib._Hash, rows: list[dict[str, Any]]) -> None:
    """Add rows to the input fingerprint: each row's JSON with sorted keys, in row order."""
    digest.update(b"".join([orjson.dumps(d, option=orjson.OPT_SORT_KEYS) for d in rows]))


def stage(store: Store, job: str, rows: Iterable[dict[str, Any]], batch_size: int,
          report: EnqueueReport, skip_existing: bool,
          on_batch: Callable[[int, int], None] | None = None) -> tuple[int, int, str]:
    """Write each batch of staged row dicts (as :mod:`producer.readers` yields them) to the
    store; return (rows, batches, input fingerprint)."""
    digest, total, n = hashlib.sha256(), 0, 0
    with BatchWriter(store) as writer:
        for n, chunk in enumerate(_chunks(rows, batch_size), start=1):
            _fingerprint(digest, chunk)
            report.bad_rows += [e for d in chunk if (e := d.get("error"))]
            key = input_key(job, n - 1)
            if not (skip_existing and store.exists(key)):
                writer.put(key, encode_rows(chunk, compress=False))
                report.staged += 1
            total += len(chunk)
            if on_batch:
                on_batch(total, n)
    return total, n, digest.hexdigest()


def count_stored_rows(pipe: redis.client.Pipeline, job: str, rows: list[dict[str, Any]],
                      sign: int = 1) -> None:
    """Add (sign=1) or take back (sign=-1) stored rows in the job's live counters, by the
    same buckets the workers count them in (quarantined is a subset of failed)."""
    stats = jobstate.Keys(job).stats
    buckets = Counter(row_bucket(x) for x in rows)
    failed = buckets["failed"] + buckets["quarantined"]
    pipe.hincrby(stats, "completed", sign * (len(rows) - failed))
    pipe.hincrby(stats, "failed", sign * failed)
    pipe.hincrby(stats, "quarantined", sign * buckets["quarantined"])
    pipe.hincrby(stats, "truncated", sign * buckets["truncated"])
    pipe.hincrby(stats, "output_tokens",
                 sign * sum(x.get("completion_tokens") or 0 for x in rows))


def _count_result(store: Store, job: str, batch: int, r: redis.Redis) -> None:
    """Add a stored batch's rows to the live counters (Redis lost them)."""
    keys = jobstate.Keys(job)
    pipe = r.pipeline()
    count_stored_rows(pipe, job, decode_rows(store.get(result_key(job, batch))))
    pipe.sadd(keys.done, batch)
    pipe.srem(keys.pending, batch)
    pipe.execute()


def reconcile(store: Store, r: redis.Redis, app: Celery, spec: JobSpec,
              report: EnqueueReport) -> None:
    """Enqueue every batch that is neither stored as done nor pending in Redis."""
    keys = jobstate.Keys(spec.name)
    stored = {b for k in store.list(results_prefix(spec.name))
              if (b := batch_of_result_key(k)) is not None}
    done = {int(b) for b in r.smembers(keys.done)}
    pending = {int(b) for b in r.smembers(keys.pending)}
    with app.producer_or_acquire() as producer:
        for b in range(spec.n_batches):
            if b in stored:
                if b not in done:
                    _count_result(store, spec.name, b, r)
                report.already_done += 1
            elif b in pending:
                report.already_pending += 1
            else:
                r.sadd(keys.pending, b)
                app.send_task("fleet.run_batch", args=[spec.name, b], queue=SHARED_QUEUE,
                              producer=producer)
                report.enqueued += 1


def enqueue(store: Store, r: redis.Redis, app: Celery, input_path: Path | str, job: str,
            batch_size: int | None, sampling: SamplingSpec, rows: Iterable[dict[str, Any]],
            on_batch: Callable[[int, int], None] | None = None,
            default_batch_size: int = 500,
            before_reconcile: Callable[[JobSpec], None] | None = None,
            dropped_keys: Mapping[str, int] | None = None) -> EnqueueReport:
    """Record, stage and enqueue a job (or resume it); see the module docstring.

    ``dropped_keys`` is filled while ``rows`` is read (producer.readers.ReadOptions.dropped).
    """
    old = _existing_spec(store, job)
    size = batch_size or (old.batch_size if old else default_batch_size)
    if old and size != old.batch_size:
        raise JobError(f"job {job!r} exists with batch size {old.batch_size}, not {size}")
    if old and sampling != old.sampling and sampling != SamplingSpec():
        raise JobError(f"job {job!r} exists with sampling {old.sampling.model_dump()}")
    placeholder = JobSpec(name=job, total=0, batch_size=size, n_batches=0,
                          input_path=str(input_path), input_fingerprint="")
    report = EnqueueReport(spec=placeholder, created=old is None)
    total, n, fingerprint = stage(store, job, rows, size, report, old is not None, on_batch)
    if total == 0:
        raise InputError(str(input_path), None, "no rows")
    if old and fingerprint != old.input_fingerprint:
        raise JobError(f"{input_path} differs from the input job {job!r} was created with "
                       "(fingerprint mismatch); use a new job name")
    spec = old or JobSpec(name=job, total=total, batch_size=size, n_batches=n,
                          input_path=str(input_path), input_fingerprint=fingerprint,
                          sampling=sampling, bad_rows=len(report.bad_rows),
                          dropped_keys=dict(dropped_keys or {}))
    if old is None:
        save_spec(store, spec)
    report.spec = spec
    jobstate.register_job(r, job, spec.model_dump_json())
    if before_reconcile:  # result reuse (producer/reuse.py) fills batches here
        before_reconcile(spec)
    reconcile(store, r, app, spec, report)
    return report


