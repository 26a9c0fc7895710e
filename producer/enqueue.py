"""Stage a prompt file into the store batch by batch and enqueue what is not done or pending.

Re-running it for the same job is the resume and reconcile command: the store says which
batches are done (their result objects exist), the broker and the owner keys say which have a
message or a live run, and only the rest is sent (workers/delivery/whereabouts.py). The input
is streamed: a batch is compressed and written on a background thread while the next one is
parsed, and at most a few batches are held in memory.

The job record keeps the sha256 of every staged batch (of its uncompressed JSONL); a worker
checks it before it uses the batch. A re-run writes nothing to the store until the input's
fingerprint matches the job's: batches whose staged object is missing or corrupt are spooled
to a local temporary folder while the input is read, and uploaded only after the check.
"""

from __future__ import annotations

import hashlib
import queue
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson
import redis
from celery import Celery

from producer.keep import KeepColumns
from producer.options import sampling_conflict
from producer.refusals import check_staged, refused_unstaged
from workers.dataset.jobs import (
    JobSpec,
    SamplingSpec,
    batch_of_input_key,
    compress_rows,
    encode_rows,
    input_key,
    load_spec,
    save_spec,
    staged_sha256,
    uncompressed,
)
from workers.dataset.samples import row_samples
from workers.dataset.store import ObjectMissing, Store
from workers.delivery import jobstate, whereabouts
from workers.delivery.lease import unacked_key
from workers.errors import InputError, JobError

# Staged batches in flight at once (compress + PUT, or a re-run's read-back check): a remote
# store answers each request slowly (tens of ms), so one request at a time would leave the
# staging of 1M prompts bound by round trips; botocore's client pools 10 connections.
PARALLEL_PUTS = 8


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
    batch_sha256: list[str] = field(default_factory=list)


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
    """Compress and store staged batches on a bounded pool of threads, PARALLEL_PUTS at once.

    zlib and file or network I/O release the GIL, so batches are compressed and written while
    the caller parses the next ones, and a slow store (S3: tens of ms per request) has
    several PUTs in flight. Each batch is its own object and the job record is written only
    after staging, so the order in which the writes finish does not matter. The queue and the
    pool are bounded, so memory stays flat when the store is the slower side. The first failed
    write (the first to fail in time) stops the writes: no batch is started after it, those
    already running finish, and its exception (a StoreError for the store's failures) is
    raised in the caller's thread by the next :meth:`put` or on leaving the ``with`` block, so
    it ends the command like any other error.

    With a ``spool`` folder (a re-run of an existing job) nothing is written to the store: a
    batch whose staged object is intact (its uncompressed sha256 is the one given) is left
    alone, and any other is compressed into the spool, to be uploaded by :meth:`upload_spool`
    once the caller has checked the input's fingerprint.
    """

    def __init__(self, store: Store, depth: int = 2, spool: Path | None = None,
                 parallel: int = PARALLEL_PUTS) -> None:
        self._store, self._spool, self._parallel = store, spool, max(1, parallel)
        self._queue: queue.Queue[tuple[str, bytes, str | None] | None] = queue.Queue(
            maxsize=depth)
        self._error: Exception | None = None
        self._lock = threading.Lock()
        self.spooled: list[str] = []
        self._thread = threading.Thread(target=self._run, name="stage-writer", daemon=True)
        self._thread.start()

    def _guarded(self, work: Callable[[str, bytes, str | None], None], key: str, data: bytes,
                 sha: str | None) -> None:
        """Run one batch's work unless a batch failed already; keep the first failure."""
        if self._error is not None:
            return
        try:
            work(key, data, sha)
        except Exception as exc:
            with self._lock:
                self._error = self._error or exc

    def _run(self) -> None:
        work = self._put if self._spool is None else self._check
        with ThreadPoolExecutor(self._parallel, thread_name_prefix="stage-io") as pool:
            pending: deque[Future[None]] = deque()
            # After a failure the queue is still drained (a put() never blocks forever), but
            # nothing more is started.
            while (item := self._queue.get()) is not None:
                if self._error is not None:
                    continue
                pending.append(pool.submit(self._guarded, work, *item))
                if len(pending) >= self._parallel:
                    wait([pending.popleft()])
            wait(pending)

    def _put(self, key: str, data: bytes, _sha: str | None) -> None:
        self._store.put(key, compress_rows(data))

    def _check(self, key: str, data: bytes, sha: str | None) -> None:
        """Spool the batch unless its staged object is intact."""
        assert self._spool is not None
        if sha is None or not staged_intact(self._store, key, sha):
            (self._spool / _spool_name(key)).write_bytes(compress_rows(data))
            with self._lock:
                self.spooled.append(key)

    @property
    def error(self) -> Exception | None:
        """The first failure of a batch so far (None while all went well)."""
        with self._lock:
            return self._error

    def _raise_error(self) -> None:
        if (error := self.error) is not None:
            raise error

    def put(self, key: str, data: bytes, sha: str | None = None) -> None:
        """Queue JSONL ``data`` to be stored compressed under ``key`` (blocks while the queue
        is full); raise the error of an earlier write, if one failed. ``sha`` is the sha256
        an intact staged object has (spool mode)."""
        self._raise_error()
        self._queue.put((key, data, sha))

    def upload_spool(self) -> int:
        """Write the spooled batches to the store, PARALLEL_PUTS at a time; return how many.
        The first failure (in key order) is raised after the running uploads finish."""
        assert self._spool is not None
        self.spooled.sort()
        spool = self._spool

        def upload(key: str) -> None:
            self._store.put(key, (spool / _spool_name(key)).read_bytes())

        with ThreadPoolExecutor(self._parallel, thread_name_prefix="stage-upload") as pool:
            list(pool.map(upload, self.spooled))
        return len(self.spooled)

    def __enter__(self) -> BatchWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Wait for the queued writes; raise a write's error unless the block raised first."""
        self._queue.put(None)
        self._thread.join()
        if exc_type is None:
            self._raise_error()


def _spool_name(key: str) -> str:
    return key.replace("/", "_")


def staged_intact(store: Store, key: str, sha: str) -> bool:
    """Whether the staged object at ``key`` exists and its JSONL has sha256 ``sha``."""
    try:
        return staged_sha256(uncompressed(store.get(key))) == sha
    except ObjectMissing:
        return False
    except JobError:  # not gzip, or cut short
        return False


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
          on_batch: Callable[[int, int], None] | None = None,
          writer: BatchWriter | None = None, recorded: list[str] | None = None,
          mark: Callable[[list[dict[str, Any]]], None] | None = None
          ) -> tuple[int, int, str]:
    """Write each batch of staged row dicts (as :mod:`producer.readers` yields them) to the
    store (or, through a spooling ``writer``, only the batches whose staged object is not
    intact: not matching ``recorded[b]``, else the input's own sha256); return (rows, batches,
    input fingerprint). ``report.batch_sha256`` gets each batch's sha256. ``mark`` quarantines
    rows of a batch (producer/context_limit.py) after the fingerprint has read them, so the
    fingerprint is the input's alone."""
    digest, total, n = hashlib.sha256(), 0, 0
    recorded = recorded or []
    with writer or BatchWriter(store) as out:
        for n, chunk in enumerate(_chunks(rows, batch_size), start=1):
            _fingerprint(digest, chunk)
            if mark is not None:
                mark(chunk)
            report.bad_rows += [e for d in chunk if (e := d.get("error"))]
            key, data = input_key(job, n - 1), encode_rows(chunk, compress=False)
            sha = staged_sha256(data)
            report.batch_sha256.append(sha)
            if writer is not None:
                out.put(key, data, recorded[n - 1] if n - 1 < len(recorded) else sha)
            elif not (skip_existing and store.exists(key)):
                out.put(key, data)
                report.staged += 1
            total += len(chunk)
            if on_batch:
                on_batch(total, n)
    return total, n, digest.hexdigest()


def reconcile(store: Store, r: redis.Redis, app: Celery, spec: JobSpec,
              report: EnqueueReport) -> None:
    """Send every batch that is not stored and has no message and no live holder
    (workers/delivery/whereabouts.py) and add what it found to ``report``."""
    found = whereabouts.reconcile(store, r, app, spec, unacked_key(app))
    report.already_done += found.already_done
    report.already_pending += found.already_pending
    report.enqueued += found.enqueued


def _stage_for(store: Store, job: str, input_path: Path, rows: Iterable[dict[str, Any]],
               size: int, report: EnqueueReport, old: JobSpec | None,
               on_batch: Callable[[int, int], None] | None,
               mark: Callable[[list[dict[str, Any]]], None] | None = None
               ) -> tuple[int, int, str]:
    """Stage a new job; for an existing one, check the fingerprint before anything is written,
    then re-stage only the batches whose staged object is missing or corrupt."""
    if old is None:
        return stage(store, job, rows, size, report, False, on_batch, mark=mark)
    with tempfile.TemporaryDirectory(prefix="fleet-stage-") as spool:
        writer = BatchWriter(store, spool=Path(spool))
        total, n, fingerprint = stage(store, job, rows, size, report, True, on_batch,
                                      writer=writer, recorded=old.input_sha256, mark=mark)
        if total and fingerprint != old.input_fingerprint:
            raise JobError(f"{input_path} differs from the input job {job!r} was created with "
                           "(fingerprint mismatch); use a new job name")
        report.staged = writer.upload_spool()
        restaged = {batch_of_input_key(k) for k in writer.spooled}
    # Intact batches keep their recorded sha256 (requeue-failed may have rewritten them).
    report.batch_sha256 = [
        old.input_sha256[b] if b not in restaged and b < len(old.input_sha256) else sha
        for b, sha in enumerate(report.batch_sha256)]
    return total, n, fingerprint


@dataclass
class JobInput:
    """What ``enqueue`` is asked to stage: the input, the job's name and parameters, and the
    rows as :mod:`producer.readers` yields them (``dropped_keys`` and ``keep``, the kept
    columns' types, fill while they are read)."""

    input_path: Path | str
    name: str
    batch_size: int | None
    sampling: SamplingSpec
    rows: Iterable[dict[str, Any]]
    dropped_keys: Mapping[str, int] | None = None
    keep: KeepColumns | None = None
    # --quality: the job's gates (workers/dataset/quality_gates.py), recorded in job.json.
    quality: dict[str, float] = field(default_factory=dict)
    # --allow-quarantine: stage a new job even when its quarantined rows break the gate.
    allow_quarantine: bool = False
    # --on-quality-warning warn|pause (None: the job's, "warn" for a new one).
    on_quality_warning: str | None = None
    # Quarantines the rows of a batch that cannot fit the model's context
    # (producer/context_limit.py, ContextLimit.mark); None: only the engine checks.
    mark: Callable[[list[dict[str, Any]]], None] | None = None


def enqueue(store: Store, r: redis.Redis, app: Celery, job_input: JobInput,
            on_batch: Callable[[int, int], None] | None = None,
            default_batch_size: int = 500,
            before_reconcile: Callable[[JobSpec], None] | None = None,
            choose_size: Callable[[Iterable[dict[str, Any]]],
                                  tuple[int, Iterable[dict[str, Any]]]] | None = None,
            ) -> EnqueueReport:
    """Record, stage and enqueue a job (or resume it); see the module docstring. A new job
    whose input breaks a refusal (producer/refusals.py) is refused with nothing staged.

    ``choose_size`` sizes a new job given no ``batch_size`` (workers/delivery/batch_size.py):
    it returns the size and the rows, the first few read ahead.
    """
    input_path, job, batch_size = job_input.input_path, job_input.name, job_input.batch_size
    sampling, rows, keep = job_input.sampling, job_input.rows, job_input.keep
    old = _existing_spec(store, job)
    samples = [0]

    def counted(rows: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for d in rows:  # every row stands for its samples (a row's own n, else the job's)
            samples[0] += row_samples(d.get("params"), sampling.samples)
            yield d

    if batch_size is None and old is None and choose_size is not None:
        batch_size, rows = choose_size(rows)
    rows = counted(rows)
    size = batch_size or (old.batch_size if old else default_batch_size)
    if old and size != old.batch_size:
        raise JobError(f"job {job!r} exists with other flags: --batch-size {old.batch_size} "
                       f"(given {size}); re-run with the job's --batch-size (or none) to "
                       "resume, or use a new job name")
    if old and sampling != old.sampling and sampling != SamplingSpec():
        raise JobError(sampling_conflict(job, old.sampling, sampling))
    placeholder = JobSpec(name=job, total=0, batch_size=size, n_batches=0,
                          input_path=str(input_path), input_fingerprint="")
    report = EnqueueReport(spec=placeholder, created=old is None)
    with refused_unstaged(store, job, old is None):
        total, n, fingerprint = _stage_for(store, job, input_path, rows, size, report, old,
                                           on_batch, job_input.mark)
        if total == 0:
            raise InputError(str(input_path), None, "no rows")
        if old is None:
            check_staged(str(input_path), report.bad_rows, total, job_input)
    kept, kept_schema = keep.record() if keep is not None else ({}, None)
    spec = old or JobSpec(name=job, total=total, batch_size=size, n_batches=n,
                          input_path=str(input_path), input_fingerprint=fingerprint,
                          sampling=sampling, bad_rows=len(report.bad_rows),
                          dropped_keys=dict(job_input.dropped_keys or {}),
                          quality=job_input.quality,
                          on_quality_warning=job_input.on_quality_warning or "warn",
                          total_samples=samples[0] if samples[0] != total else 0,
                          keep_columns=kept, keep_schema=kept_schema,
                          keep_arg=",".join(keep.wanted) if keep is not None else None)
    pause = job_input.on_quality_warning
    if old is None or spec.input_sha256 != report.batch_sha256 or (
            pause and pause != spec.on_quality_warning):  # a re-run may change the reaction
        spec = spec.model_copy(update={"input_sha256": report.batch_sha256,
                                       "on_quality_warning": pause or spec.on_quality_warning})
        save_spec(store, spec)
    report.spec = spec
    jobstate.register_job(r, job, spec.model_dump_json(), store.url)
    if before_reconcile:  # result reuse (producer/reuse.py) fills batches here
        before_reconcile(spec)
    reconcile(store, r, app, spec, report)
    return report
