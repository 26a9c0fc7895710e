"""What every export reads and how it writes: the committed data set and the job's manifest.

Each shard is checked against the sha256 in the manifest before a row of it is used
(:func:`shard_tables`). An output appears only when complete: it is written beside its path
and renamed over it (:func:`atomic_file`, :func:`atomic_dir`). Rows an export cannot turn into
a training row (failed and quarantined ones) go to the side file ``<out>.errors.jsonl`` with
their reason (:class:`ErrorFile`), so that ``ok + errors`` is the data set's row count.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from workers.dataset.jobs import JobSpec, load_spec
from workers.dataset.kept import decode_schema
from workers.dataset.manifest import SCHEMA, load_manifest, row_bucket
from workers.dataset.store import FILE_MODE, RetryingStore, Store, fsync_dir
from workers.errors import JobError, StoreError
from workers.retry import RetryPolicy

if TYPE_CHECKING:
    from producer.exports.sent import SentRequests


def shard_tables(store: Store, manifest: dict[str, Any], tmp: Path) -> Iterator[pa.Table]:
    """Row groups of every shard, in order, after checking each shard's sha256."""
    for shard in manifest["shards"]:
        path = tmp / Path(shard["key"]).name
        digest = hashlib.sha256()
        with path.open("wb") as fh:
            store.get_into(shard["key"], fh)
        with path.open("rb") as fh:
            while chunk := fh.read(8 * 2**20):
                digest.update(chunk)
        if digest.hexdigest() != shard["sha256"]:
            raise StoreError(f"{shard['key']} does not match its sha256 in the manifest")
        pf = pq.ParquetFile(path)
        for group in range(pf.num_row_groups):
            yield pf.read_row_group(group)
        pf.close()
        path.unlink()


@dataclass
class DataSet:
    """A job's committed data set, opened for one export."""

    job: str
    store: Store
    manifest: dict[str, Any]
    spec: JobSpec

    @classmethod
    def open(cls, store: Store, job: str) -> DataSet:
        """The data set of ``job``; JobError when the sink has not written one."""
        store = RetryingStore(store, RetryPolicy(max_attempts=10))
        manifest = load_manifest(store, job)
        if manifest is None:
            raise JobError(f"job {job!r} has no data set yet; run: fleet sink --job {job} "
                           "--local (a GPU worker's sink queue builds it when the job ends)")
        return cls(job, store, manifest, load_spec(store, job))

    @property
    def rows(self) -> int:
        """Rows the manifest counts (every (prompt, sample))."""
        return int(self.manifest.get("totals", {}).get("rows") or 0)

    @contextlib.contextmanager
    def tables(self) -> Iterator[Iterator[pa.Table]]:
        """The shards' row groups, checked, read through a scratch folder."""
        with tempfile.TemporaryDirectory(prefix="fleet-export-") as work:
            yield shard_tables(self.store, self.manifest, Path(work))

    @functools.cached_property
    def requests(self) -> SentRequests:
        """The requests the worker sent, rebuilt from the staged inputs (one reader per
        export, shared by the rows it writes and the rows it judges)."""
        from producer.exports.sent import SentRequests

        return SentRequests(self.store, self.spec)

    @property
    def sampling(self) -> dict[str, Any]:
        """The job's sampling as the manifest records it."""
        return dict(self.manifest["params"].get("sampling") or {})

    def kept_fields(self) -> list[pa.Field]:
        """The kept input columns (``enqueue --keep-columns``), as the data set types them."""
        schema = decode_schema(self.spec.keep_schema)
        return [] if schema is None else list(schema)

    def failed_gates(self) -> list[dict[str, Any]]:
        """The quality gates the data set failed when it was committed."""
        return list((self.manifest.get("quality") or {}).get("failed") or [])

    def models(self) -> dict[str, str]:
        """Launch profile -> its model (the profile's --model-path), as the manifest says."""
        return {name: p.get("model") or name
                for name, p in self.manifest["params"].get("profiles", {}).items()}

    def model_paths(self) -> list[str]:
        """The job's models, most rows first."""
        profiles = self.manifest["params"].get("profiles", {})
        ranked = sorted(profiles.items(), key=lambda kv: -int(kv[1].get("rows") or 0))
        return [p["model"] for _, p in ranked if p.get("model")]


def kept_columns(rec: dict[str, Any]) -> dict[str, Any]:
    """The kept input columns of a data-set row (every column after SCHEMA's)."""
    return {k: v for k, v in rec.items() if k not in SCHEMA.names}


def with_kept(fields: list[pa.Field], kept: list[pa.Field], fmt: str) -> pa.Schema:
    """An export's schema with the kept columns after its own; JobError on a name clash."""
    names = {f.name for f in fields}
    if clash := sorted(names & {f.name for f in kept}):
        raise JobError(f"kept column {clash[0]!r} has the name of a {fmt} export column; "
                       "rename it in the input to export it")
    return pa.schema([*fields, *kept])


def errors_path(out: Path) -> Path:
    """``<out>.errors.jsonl`` beside ``out`` (a folder's beside the folder)."""
    return out.with_name(f"{out.name}.errors.jsonl")


def error_line(rec: dict[str, Any]) -> dict[str, Any]:
    """The side-file line of a row no training row was made of, with its reason."""
    return {"input_id": rec["id"], "index": rec["index"], "sample": rec.get("sample") or 0,
            "bucket": row_bucket(rec), "status": rec["status"],
            "error": rec.get("error") or "", "finish_reason": rec.get("finish_reason")}


@dataclass
class Tally:
    """What an export wrote: ``ok + errors`` is every row it read."""

    ok: int = 0
    errors: int = 0
    lines: int = 0  # lines (or rows) of the output itself
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        """Rows read from the data set."""
        return self.ok + self.errors


@contextlib.contextmanager
def atomic_file(out: Path) -> Iterator[Path]:
    """A temporary path beside ``out``, renamed over it when the block ends without error."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, FILE_MODE)  # mkstemp made it 0600
        os.replace(tmp, out)
        fsync_dir(out.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out`` that replaces it when the block ends without error."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class ErrorFile:
    """The side file of rows left out of an export, written atomically like the export."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh = fh
        self.count = 0

    def add(self, rec: dict[str, Any], fault: tuple[str, str] | None = None) -> None:
        """Record one left-out row with its reason (``fault``: the row-level gate that left
        an answered row out, and why)."""
        line = error_line(rec)
        if fault is not None:
            line["bucket"], line["error"] = fault
        self.fh.write(orjson.dumps(line, default=str) + b"\n")
        self.count += 1

    def usable(self, recs: list[dict[str, Any]], judge: Judge | None = None
               ) -> list[dict[str, Any]]:
        """The rows of ``recs`` an export turns into training rows; the others (failed and
        quarantined, and with ``judge`` the answered rows it faults) are recorded here."""
        ok = []
        for rec in recs:
            fault = None if rec["status"] != "ok" or judge is None else judge(rec)
            if rec["status"] != "ok" or fault is not None:
                self.add(rec, fault)
            else:
                ok.append(rec)
        return ok


# An answered row's row-level fault (gate, reason), or None when it is usable.
Judge = Callable[[dict[str, Any]], "tuple[str, str] | None"]


@dataclass
class ExportRun:
    """What one ``fleet export`` asks beyond the data set and the output path."""

    # --usable-only: answered rows that fail a row-level quality gate go to the errors file.
    judge: Judge | None = None
    # --license: the hf card's license.
    license: str = "other"
    # The token exports: the model's tokenizer (producer.exports.engine_tokens.EngineTokens)
    # and the rows compared with the engine's ids (Checks).
    engine: Any = None
    checks: Any = None


@contextlib.contextmanager
def error_file(out: Path) -> Iterator[ErrorFile]:
    """:class:`ErrorFile` at ``<out>.errors.jsonl``."""
    with atomic_file(errors_path(out)) as tmp, tmp.open("wb") as fh:
        yield ErrorFile(fh)
