"""``fleet export --format parquet | jsonl``: the data set as it is, in one file.

``parquet`` keeps the data set's own schema (its kept columns' types included); ``jsonl`` is
one data-set row per line. Every row is written, failed ones too (their ``status`` and
``error`` say so), so ``lines`` is the data set's row count.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow.parquet as pq

from producer.exports.source import DataSet, ExportRun, Tally, atomic_file
from workers.dataset.manifest import SCHEMA


def _count(tally: Tally, statuses: list[str | None]) -> None:
    ok = sum(s == "ok" for s in statuses)
    tally.ok += ok
    tally.errors += len(statuses) - ok
    tally.lines += len(statuses)


def write_parquet(data: DataSet, out: Path, run: ExportRun | None = None) -> Tally:
    """One Parquet file with the data set's schema."""
    tally, writer = Tally(), None
    with atomic_file(out) as tmp, data.tables() as tables:
        try:
            for table in tables:
                if writer is None:
                    writer = pq.ParquetWriter(tmp, table.schema, compression="zstd",
                                              compression_level=3)
                writer.write_table(table, row_group_size=max(table.num_rows, 1))
                _count(tally, table.column("status").to_pylist())
            if writer is None:
                pq.write_table(SCHEMA.empty_table(), tmp, compression="zstd")
        finally:
            if writer is not None:
                writer.close()
    return tally


def write_jsonl(data: DataSet, out: Path, run: ExportRun | None = None) -> Tally:
    """One data-set row per line."""
    tally = Tally()
    with atomic_file(out) as tmp, tmp.open("wb") as fh, data.tables() as tables:
        for table in tables:
            rows = table.to_pylist()
            fh.write(b"".join(orjson.dumps(rec, default=str) + b"\n" for rec in rows))
            _count(tally, [r["status"] for r in rows])
    return tally
