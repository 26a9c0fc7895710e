"""``fleet export --format tokens [--tokenizer PATH]``: Parquet of ``input_ids`` and
``loss_mask`` per (prompt, sample), the rows vLLM speculators' regeneration writes.

Columns: ``id`` (content hash of the input and the sample), ``primary_id`` (content hash of
the input alone: the samples of one prompt share it), ``input_id`` (the input's own id),
``sample``, ``input_ids`` list<int32>, ``loss_mask`` list<int8> (1 over the generated
assistant turn, :mod:`producer.exports.chat_tokenizer`), ``text`` (the rendered
conversation), ``finish_reason``, ``engine_ids_match`` (whether the span equals the engine's
own ``output_ids``; null where none were stored) and ``sampling`` (the job's sampling, JSON).
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

from producer.exports.chat_tokenizer import ChatTokenizer
from producer.exports.conversation import (
    Message,
    assistant_turn,
    content_id,
    input_messages,
    row_tools,
)
from producer.exports.source import DataSet, Tally, atomic_file, error_file
from workers.errors import JobError

TOKENS_SCHEMA = pa.schema([
    pa.field("id", pa.string()), pa.field("primary_id", pa.string()),
    pa.field("input_id", pa.string()), pa.field("sample", pa.int32()),
    pa.field("input_ids", pa.list_(pa.int32())), pa.field("loss_mask", pa.list_(pa.int8())),
    pa.field("text", pa.string()), pa.field("finish_reason", pa.string()),
    pa.field("engine_ids_match", pa.bool_()), pa.field("sampling", pa.string()),
])
# The data-set columns this export reads (the rest are not converted to Python).
COLUMNS = ("index", "sample", "id", "prompt", "messages", "completion", "reasoning",
           "tool_calls", "finish_reason", "status", "error", "output_ids")


def default_tokenizer(data: DataSet) -> Path:
    """The job's launch-profile model folder (the profile with the most rows first)."""
    for model in data.model_paths():
        if Path(model).is_dir():
            return Path(model)
    shown = ", ".join(data.model_paths()) or "none recorded"
    raise JobError(f"job {data.job!r}: its model ({shown}) is not a folder here; "
                   "pass --tokenizer PATH (a folder with tokenizer.json and a chat template)")


def _lists(rows: list[list[int]], dtype: Any, kind: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    flat = np.fromiter(chain.from_iterable(rows), dtype=dtype, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=kind))


def _masks(encoded_ids: list[list[int]], spans: list[tuple[int, int]]) -> pa.Array:
    lengths = np.array([len(r) for r in encoded_ids], dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.zeros(int(offsets[-1]), dtype=np.int8)
    for base, (start, end) in zip(offsets[:-1], spans, strict=False):
        flat[base + start:base + end] = 1
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=pa.int8()))


class TokensWriter:
    """Batches of answered rows -> Parquet row groups; counts the engine-id mismatches."""

    def __init__(self, chat: ChatTokenizer, sampling: dict[str, Any], path: Path) -> None:
        self.chat, self.sampling = chat, sampling
        self.sampling_text = orjson.dumps(sampling, option=orjson.OPT_SORT_KEYS).decode()
        self.writer = pq.ParquetWriter(path, TOKENS_SCHEMA, compression="zstd",
                                       compression_level=1)
        self.with_ids = self.differ = 0

    def add(self, recs: list[dict[str, Any]]) -> None:
        """Tokenize and write one batch of ``status == "ok"`` rows."""
        if not recs:
            return
        ids, primary, convs = [], [], []
        for rec in recs:
            messages = input_messages(rec, self.sampling)
            tools = row_tools(rec)
            turn: Message = assistant_turn(rec)
            sample = rec.get("sample") or 0
            ids.append(content_id(messages, tools, sample, turn))
            primary.append(content_id(messages, tools, -1))
            convs.append(([*messages, turn], tools))
        texts = self.chat.render_many(convs)
        enc = self.chat.encode(texts)
        match: list[bool | None] = []
        for rec, row, (start, end) in zip(recs, enc.ids, enc.spans, strict=True):
            engine = rec.get("output_ids")
            if engine is None:
                match.append(None)
                continue
            same = self.chat.matches(row[start:end], list(engine))
            self.with_ids += 1
            self.differ += not same
            match.append(same)
        table = pa.table({
            "id": ids, "primary_id": primary, "input_id": [r["id"] for r in recs],
            "sample": pa.array([r.get("sample") or 0 for r in recs], pa.int32()),
            "input_ids": _lists(enc.ids, np.int32, pa.int32()),
            "loss_mask": _masks(enc.ids, enc.spans), "text": texts,
            "finish_reason": [r.get("finish_reason") for r in recs],
            "engine_ids_match": pa.array(match, pa.bool_()),
            "sampling": pa.array([self.sampling_text] * len(recs)).dictionary_encode()
            .cast(pa.string()),
        }, schema=TOKENS_SCHEMA)
        self.writer.write_table(table)

    def close(self) -> None:
        """Finish the Parquet file."""
        self.writer.close()


def write_tokens(data: DataSet, out: Path, tokenizer: Path | None = None) -> Tally:
    """Write the tokens Parquet of ``data`` to ``out`` (and its errors side file)."""
    sampling = data.manifest["params"].get("sampling") or {}
    chat = ChatTokenizer(tokenizer or default_tokenizer(data),
                         sampling.get("chat_template_kwargs"))
    tally = Tally()
    with atomic_file(out) as tmp, error_file(out) as errors, data.tables() as tables:
        writer = TokensWriter(chat, sampling, tmp)
        try:
            for table in tables:
                names = [c for c in COLUMNS if c in table.column_names]
                if "tools" in table.column_names:
                    names.append("tools")
                ok = []
                for rec in table.select(names).to_pylist():
                    if rec["status"] == "ok":
                        ok.append(rec)
                    else:
                        errors.add(rec)
                writer.add(ok)
                tally.ok += len(ok)
        finally:
            writer.close()
        tally.errors = errors.count
    tally.lines = tally.ok
    tally.extra = {"tokenizer": str(chat.path), "with_engine_ids": writer.with_ids,
                   "differ": writer.differ}
    return tally
