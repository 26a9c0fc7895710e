"""``fleet export --format tokens [--tokenizer PATH]``: Parquet of the training rows.

The rows of the ``speculators`` and ``specforge`` exports (:mod:`producer.exports.engine_tokens`:
the context the engine was sent, mask 0, then the tokens it generated, mask 1) as one Parquet
file. Columns: ``id`` (content hash of the request, the sample and the answer), ``primary_id``
(of the request alone: the samples of one prompt share it), ``input_id`` (the input's own id),
``sample``, ``input_ids`` list<int32>, ``loss_mask`` list<int8>, ``text`` (the ids decoded,
special tokens shown), ``finish_reason``, ``engine_ids`` (whether the answer is the engine's
own ``output_ids``), ``differs`` (``context`` / ``answer`` where the row disagrees with what the
engine reported, else null), ``sampling`` (the job's, JSON), then the kept input columns.
``PATH`` defaults to the job's launch-profile model folder. Failed and quarantined rows go to
``<out>.errors.jsonl``.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from producer.exports.source import DataSet, ExportRun, Tally, atomic_file, error_file, with_kept
from producer.exports.training import Row, training_rows

TOKENS_FIELDS = [
    pa.field("id", pa.string()), pa.field("primary_id", pa.string()),
    pa.field("input_id", pa.string()), pa.field("sample", pa.int32()),
    pa.field("input_ids", pa.list_(pa.int32())), pa.field("loss_mask", pa.list_(pa.int8())),
    pa.field("text", pa.string()), pa.field("finish_reason", pa.string()),
    pa.field("engine_ids", pa.bool_()), pa.field("differs", pa.string()),
    pa.field("sampling", pa.string()),
]


def _lists(rows: list[list[int]], dtype: Any, kind: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    flat = np.fromiter(chain.from_iterable(rows), dtype=dtype, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=kind))


def _table(rows: list[Row], texts: list[str], sampling: str, schema: pa.Schema) -> pa.Table:
    cols: dict[str, Any] = {
        "id": [r.id for r in rows], "primary_id": [r.primary_id for r in rows],
        "input_id": [r.rec["id"] for r in rows],
        "sample": pa.array([r.rec.get("sample") or 0 for r in rows], pa.int32()),
        "input_ids": _lists([r.tokens.input_ids for r in rows], np.int32, pa.int32()),
        "loss_mask": _lists([r.tokens.loss_mask for r in rows], np.int8, pa.int8()),
        "text": texts, "finish_reason": [r.rec.get("finish_reason") for r in rows],
        "engine_ids": [r.tokens.engine_ids for r in rows],
        "differs": [r.tokens.differs or None for r in rows],
        "sampling": [sampling] * len(rows),
    }
    for f in schema:
        if f.name not in cols:
            cols[f.name] = pa.array([r.rec.get(f.name) for r in rows], f.type)
    return pa.table(cols, schema=schema)


def write_tokens(data: DataSet, out: Path, run: ExportRun) -> Tally:
    """Write the tokens Parquet of ``data`` to ``out`` (and its errors side file)."""
    schema = with_kept(TOKENS_FIELDS, data.kept_fields(), "tokens")
    sampling = orjson.dumps(data.sampling, option=orjson.OPT_SORT_KEYS).decode()
    tally = Tally()
    with atomic_file(out) as tmp, error_file(out) as errors, data.tables() as tables:
        writer = pq.ParquetWriter(tmp, schema, compression="zstd", compression_level=1)
        try:
            for rows in training_rows(data, run, tables, errors):
                texts = run.engine.decode([r.tokens.input_ids for r in rows])
                writer.write_table(_table(rows, texts, sampling, schema))
                tally.ok += len(rows)
        finally:
            writer.close()
        tally.errors = errors.count
    tally.lines = tally.ok
    return tally
