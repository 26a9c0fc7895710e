"""The sink: aggregate a job's per-batch results into a new version of its Parquet data set.

It runs as the task ``fleet.sink_job`` (:mod:`workers.wiring.sink_task`) on a GPU worker's
``sink`` queue when a job's last batch is stored (no separate sink worker is needed), or
in-process with ``fleet sink --job NAME --local`` (the same run, state and retries); both hold
the job's data-set lock (:mod:`workers.dataset.sink_lock`) for the whole run. Batches are
read in order; rows go into a shard sorted by index; a shard is cut at the first batch
boundary where its file reaches ``shard_target_bytes`` or it holds ``shard_rows`` rows, so a
batch is in exactly one shard.

The commit protocol (layout in workers/dataset/manifest.py):

1. every shard is written under a new prefix ``data/<version>/`` (a local temporary file,
   hashed, then uploaded with a managed, multipart transfer);
2. ``_SUCCESS`` is removed and the manifest, naming that version, is written in one put:
   this is the commit point;
3. ``_SUCCESS`` is written when the rows written (not a separate read) hold every prompt
   exactly once;
4. only then are the other versions under ``data/`` deleted.

A run killed at any step leaves the previous manifest and its version intact (before 2) or the
new ones (after 2). A re-run that produces the same shards keeps the committed version and
drops its own, so running the sink twice changes no byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from config.settings import Settings
from workers.dataset.jobs import JobSpec, load_spec
from workers.dataset.kept import kept_array
from workers.dataset.location import locate
from workers.dataset.manifest import (
    SCHEMA,
    ShardInfo,
    build_manifest,
    data_prefix,
    encode_manifest,
    job_schema,
    load_manifest,
    manifest_key,
    shard_key,
    shard_name,
    shards_digest,
    success_body,
    success_key,
    to_record,
    version_prefix,
)
from workers.dataset.quality_gates import summary
from workers.dataset.quality_table import add_table
from workers.dataset.sink_lock import LockLost, SinkLock
from workers.dataset.store import ObjectMissing, RetryingStore, Store
from workers.dataset.verify import (
    RowCheck,
    iter_batches,
    prefetched,
    stored_batches,
)
from workers.retry import RetryPolicy

log = logging.getLogger(__name__)

STALE_PARTIAL_S = 24 * 3600.0
StepHook = Callable[[str], None]

__all__ = ["prefetched", "stored_batches", "aggregate"]


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

    def __init__(self, path: Path, schema: pa.Schema = SCHEMA,
                 on_table: Callable[[pa.Table], None] | None = None) -> None:
        self.path, self.schema, self._on_table = path, schema, on_table
        self._kept = [f for f in schema if f.name not in SCHEMA.names]
        self._file = pa.OSFile(str(path), "wb")
        self._writer = pq.ParquetWriter(self._file, schema, compression="zstd",
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
        self._buf += [{**to_record(r), "keep": r.get("keep")} for r in rows]
        self.buffered_bytes += raw_bytes
        self.rows += len(rows)
        self.batches.append(batch)
        self.indices += [rows[0]["index"], rows[-1]["index"]]

    def flush(self) -> None:
        """Write the buffered rows as one row group."""
        if self._buf:
            table = pa.Table.from_pylist(self._buf, schema=SCHEMA)
            if self._on_table is not None:  # the quality of the rows, measured on the table
                self._on_table(table)
            for f in self._kept:  # kept input columns, cast to the types recorded at enqueue
                values = [(r["keep"] or {}).get(f.name) for r in self._buf]
                table = table.append_column(f, kept_array(f, values))
            self._writer.write_table(table, row_group_size=len(self._buf))
        self._buf, self.buffered_bytes = [], 0

    def close(self) -> None:
        """Flush and finish the file (footer included)."""
        self.flush()
        self._writer.close()
        self._file.close()


def _sha256_and_size(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with path.open("rb") as fh:
        while chunk := fh.read(8 * 2**20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _finish(store: Store, job: str, key: str, shard: ShardWriter) -> ShardInfo:
    """Close a shard, hash it and upload it under ``key``; return its manifest entry."""
    shard.close()
    sha, size = _sha256_and_size(shard.path)
    with shard.path.open("rb") as fh:
        store.put_stream(key, fh)
    shard.path.unlink()
    log.info("sink %s: wrote %s (%d rows, %d bytes)", job, key, shard.rows, size)
    return ShardInfo(key=key, rows=shard.rows, first_index=min(shard.indices),
                     last_index=max(shard.indices), first_batch=shard.batches[0],
                     last_batch=shard.batches[-1], bytes=size, sha256=sha)


def write_shards(store: Store, spec: JobSpec, limits: ShardLimits, tmp: Path, version: str
                 ) -> tuple[list[ShardInfo], RowCheck]:
    """Write every stored batch into shards under ``version``; return the shard entries and
    the check of exactly the rows written (duplicates and misplaced rows are left out)."""
    shards: list[ShardInfo] = []
    check, cur = RowCheck(spec, defer_quality=True), None
    schema = job_schema(spec)

    def measure(table: pa.Table) -> None:
        add_table(check.quality, table)
        check.quality.options.clear_rows()  # the next row group's rows come in view

    for batch, raw, stored, ids, samples, staged in iter_batches(store, spec):
        check.samples = samples
        check.quality.options.add_rows(staged)  # their own structured output, if any
        rows = [row for row in stored if check.accept(batch, row, ids)]
        if not rows:
            continue
        cur = cur or ShardWriter(tmp / shard_name(len(shards)), schema, measure)
        cur.add(batch, rows, len(raw))
        if cur.buffered_bytes >= limits.row_group_bytes:
            cur.flush()
        if cur.rows >= limits.rows or cur.written_bytes >= limits.target_bytes:
            shards.append(_finish(store, spec.name,
                                  shard_key(spec.name, version, len(shards)), cur))
            cur = None
    if cur is not None:
        shards.append(_finish(store, spec.name, shard_key(spec.name, version, len(shards)), cur))
    return shards, check


def new_version(previous: dict[str, Any] | None) -> str:
    """A version name no earlier run used: the committed one's number plus one, and a nonce."""
    seq = 0
    if previous and isinstance(previous.get("version"), str):
        with contextlib.suppress(ValueError):
            seq = int(previous["version"][1:].split("-")[0])
    return f"v{seq + 1:06d}-{uuid.uuid4().hex[:8]}"


def _finished_at(previous: dict[str, Any] | None, shards: list[ShardInfo]) -> float:
    """Keep the earlier time when the shards are unchanged, so a re-run changes no byte."""
    if previous and previous.get("digest") == shards_digest(shards):
        return float(previous["finished_at_unix"])
    return time.time()


_PER_RUN = ("version", "data_prefix")


def _same_data_set(previous: dict[str, Any] | None, manifest: dict[str, Any]) -> bool:
    """Whether ``previous`` is ``manifest`` but for the version the shards were written under."""
    if not previous or previous.get("format") != manifest["format"]:
        return False

    def comparable(m: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in m.items() if k not in _PER_RUN}
        out["shards"] = [{**x, "key": x["key"].rsplit("/", 1)[-1]} for x in m["shards"]]
        return out

    return comparable(previous) == comparable(manifest)


def _no_step(step: str) -> None:
    """Default step hook: nothing (tests pass one that kills the run at a given step)."""


def _delete_prefix(store: Store, prefix: str) -> None:
    for key in store.list(prefix):
        store.delete(key)


def _drop_other_versions(store: Store, job: str, keep: str, lock: SinkLock | None,
                         on_step: StepHook) -> None:
    """After the commit: delete every object under data/ that is not in version ``keep``."""
    if lock is not None:
        lock.check()
    for key in store.list(data_prefix(job)):
        if not key.startswith(keep):
            if lock is not None and lock.lost:
                raise LockLost(f"lost the lock on the data set of job {job} during clean-up")
            store.delete(key)
            on_step("cleanup")


def _commit(store: Store, job: str, manifest: dict[str, Any], lock: SinkLock | None,
            on_step: StepHook) -> None:
    """Make ``manifest`` the committed data set: ``_SUCCESS`` goes, the manifest is written
    (the commit point), then ``_SUCCESS`` again if the data set is complete."""
    if lock is not None:
        lock.check()
    data = encode_manifest(manifest)
    store.delete(success_key(job))
    store.put(manifest_key(job), data)
    on_step("manifest-written")
    if manifest["complete"]:
        store.put(success_key(job), success_body(data))
        on_step("success-written")


def _ensure_success(store: Store, job: str, manifest: dict[str, Any]) -> None:
    """``_SUCCESS`` matches the committed manifest when it is complete (a run killed between
    the manifest and the marker is repaired here), and is absent otherwise."""
    if not manifest["complete"]:
        store.delete(success_key(job))
        return
    body = success_body(encode_manifest(manifest))
    try:
        if store.get(success_key(job)) == body:
            return
    except ObjectMissing:
        pass
    store.put(success_key(job), body)


def aggregate(store: Store, job: str, limits: ShardLimits,
              policy: RetryPolicy | None = None, lock: SinkLock | None = None,
              on_step: StepHook = _no_step) -> dict[str, Any]:
    """Write a new version of the job's data set and commit it (see the module docstring);
    return a summary. ``lock`` is checked before the commit and before deleting anything;
    ``on_step`` is called after each step (``shards-written``, ``manifest-written``,
    ``success-written``, ``cleanup`` per deleted object)."""
    store = RetryingStore(store, policy or RetryPolicy(max_attempts=10))
    spec = load_spec(store, job)
    # Leftovers of killed writers: under data/ they are a sink's (ours, under the lock); in
    # the rest of the job only once they are old enough that no live writer owns them.
    store.clean_partial(data_prefix(job))
    store.clean_partial(f"jobs/{job}/", STALE_PARTIAL_S)
    previous = load_manifest(store, job)
    version = new_version(previous)
    with tempfile.TemporaryDirectory(prefix="fleet-sink-") as tmp:
        shards, check = write_shards(store, spec, limits, Path(tmp), version)
    on_step("shards-written")
    report = check.report()
    location = locate(store.url, getattr(store, "endpoint_url", None)).to_json()
    manifest = build_manifest(spec, version, shards, check.tally, report,
                              _finished_at(previous, shards), location)
    if previous is not None and _same_data_set(previous, manifest):
        # Same bytes as the committed version: keep it (and its manifest), drop ours.
        manifest = previous
        if lock is not None:
            lock.check()
        _delete_prefix(store, version_prefix(job, version))
        _ensure_success(store, job, manifest)
    else:
        _commit(store, job, manifest, lock, on_step)
    _drop_other_versions(store, job, manifest["data_prefix"], lock, on_step)
    log.info("sink %s: %d rows in %d shards (version %s), complete=%s, %s", job,
             manifest["totals"]["rows"], len(shards), manifest["version"], manifest["complete"],
             summary((manifest.get("quality") or {}).get("failed", [])))
    return {"job": job, "complete": manifest["complete"], "manifest": manifest_key(job),
            "version": manifest["version"], "data_prefix": manifest["data_prefix"],
            "shards": len(shards), "rows": manifest["totals"]["rows"],
            "bytes": manifest["totals"]["bytes"], "counts": manifest["counts"],
            "missing": report["missing"], "duplicates": report["duplicates"],
            "misplaced": report["misplaced"],
            "quality_failed": (manifest.get("quality") or {}).get("gates_failed", [])}
