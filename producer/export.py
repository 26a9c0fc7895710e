"""``python -m producer export``: write a job's data set as Parquet, JSONL or OpenAI-batch output.

The source is the aggregated data set (manifest.json and its shards, written by the sink);
each shard is checked against the sha256 in the manifest before a row of it is used. The
output appears only when complete (written beside PATH, then renamed over it).

``openai-batch`` lines follow the OpenAI Batch output file: ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}``; the body is a
``chat.completion`` for chat rows and a ``text_completion`` for plain prompts. A failed row is
a per-request failure, which that format reports in the response (the OpenAPI schema
``BatchRequestOutput`` of openai-openapi: ``error`` is only "for requests that failed with a
non-HTTP error"): ``"response": {"status_code": 400 | 500, "request_id", "body": {"error":
{"message", "type", "param", "code"}}}, "error": null``; 400 with ``invalid_request_error`` for
quarantined rows, 500 with ``server_error`` for generation failures. Every id is derived from
the job and row index, so an export is reproducible.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from workers.dataset.manifest import SCHEMA, load_manifest, row_bucket
from workers.dataset.store import FILE_MODE, RetryingStore, Store, fsync_dir
from workers.errors import JobError, StoreError
from workers.retry import RetryPolicy

FORMATS = ("parquet", "jsonl", "openai-batch")


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


def _ids(job: str, index: int) -> str:
    return hashlib.sha256(f"{job}\0{index}".encode()).hexdigest()[:24]


def _kept(rec: dict[str, Any]) -> dict[str, Any]:
    """The kept input columns of a data-set row (every column after SCHEMA's)."""
    return {k: v for k, v in rec.items() if k not in SCHEMA.names}


def _choice(rec: dict[str, Any], chat: bool) -> dict[str, Any]:
    """One sample of a row as an OpenAI choice (its ``index`` is the sample)."""
    index = rec.get("sample") or 0
    if not chat:
        return {"index": index, "text": rec["completion"], "logprobs": None,
                "finish_reason": rec["finish_reason"]}
    message: dict[str, Any] = {"role": "assistant", "content": rec["completion"]}
    if rec["reasoning"] is not None:
        message["reasoning_content"] = rec["reasoning"]
    if rec.get("tool_calls"):
        message["tool_calls"] = orjson.loads(rec["tool_calls"])
    return {"index": index, "message": message, "logprobs": None,
            "finish_reason": rec["finish_reason"]}


def _body(recs: list[dict[str, Any]], rid: str, created: int, model: str) -> dict[str, Any]:
    """The response body of one prompt: one choice per sample that finished (as OpenAI's
    ``n``); the prompt's tokens counted once, the completions' summed."""
    rec = recs[0]
    completion = sum(r["completion_tokens"] or 0 for r in recs)
    usage = {"prompt_tokens": rec["prompt_tokens"] or 0, "completion_tokens": completion,
             "total_tokens": (rec["prompt_tokens"] or 0) + completion}
    chat = not (rec["messages"] is None and rec["prompt"] is not None)
    choices = [_choice(r, chat) for r in recs]
    if not chat:
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created,
                "model": model, "choices": choices, "usage": usage}
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created,
            "model": model, "choices": choices, "usage": usage}


def openai_line(rec: dict[str, Any] | list[dict[str, Any]], created: int,
                models: dict[str, str]) -> dict[str, Any]:
    """One prompt's data-set rows (its samples) as a line of an OpenAI Batch output file;
    kept input columns under ``columns``. A prompt none of whose samples finished is reported
    with the first one's error."""
    recs = rec if isinstance(rec, list) else [rec]
    done = [r for r in recs if r["status"] == "ok"]
    rec = done[0] if done else recs[0]
    rid = _ids(rec["job"], rec["index"])
    line: dict[str, Any] = {"id": f"batch_req_{rid}", "custom_id": rec["id"]}
    if kept := _kept(rec):
        line["columns"] = kept
    if not done:
        status, kind, code = ((400, "invalid_request_error", "quarantined")
                              if row_bucket(rec) == "quarantined"
                              else (500, "server_error", "generation_failed"))
        body = {"error": {"message": rec["error"], "type": kind, "param": None, "code": code}}
        return line | {"response": {"status_code": status, "request_id": f"req_{rid}",
                                    "body": body}, "error": None}
    model = models.get(rec["profile"] or "", rec["profile"] or "")
    body = _body(done, rid, created, model)
    return line | {"response": {"status_code": 200, "request_id": f"req_{rid}", "body": body},
                   "error": None}


def _models(manifest: dict[str, Any]) -> dict[str, str]:
    return {name: p.get("model") or name
            for name, p in manifest["params"].get("profiles", {}).items()}


def _write_lines(tables: Iterator[pa.Table], fh: IO[bytes], fmt: str,
                 manifest: dict[str, Any]) -> int:
    created = int(manifest.get("finished_at_unix") or 0)
    models, rows = _models(manifest), 0
    prompt: list[dict[str, Any]] = []  # the samples of one prompt (consecutive in the data set)

    def emit() -> None:
        if prompt:
            fh.write(orjson.dumps(openai_line(prompt, created, models), default=str) + b"\n")
            prompt.clear()

    for table in tables:
        for rec in table.to_pylist():
            rows += 1
            if fmt == "jsonl":
                fh.write(orjson.dumps(rec, default=str) + b"\n")
                continue
            if prompt and prompt[0]["index"] != rec["index"]:
                emit()
            prompt.append(rec)
    emit()
    return rows


def _write_parquet(tables: Iterator[pa.Table], path: Path) -> int:
    """One Parquet file with the data set's own schema (its kept columns' types included)."""
    rows, writer = 0, None
    try:
        for table in tables:
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema, compression="zstd",
                                          compression_level=3)
            writer.write_table(table, row_group_size=max(table.num_rows, 1))
            rows += table.num_rows
        if writer is None:
            pq.write_table(SCHEMA.empty_table(), path, compression="zstd")
    finally:
        if writer is not None:
            writer.close()
    return rows


def export(store: Store, job: str, fmt: str, out: Path) -> dict[str, Any]:
    """Write the data set of ``job`` to ``out`` in ``fmt``; return what was written."""
    if fmt not in FORMATS:
        raise JobError(f"unknown format {fmt!r} (use {', '.join(FORMATS)})")
    store = RetryingStore(store, RetryPolicy(max_attempts=10))
    manifest = load_manifest(store, job)
    if manifest is None:
        raise JobError(f"job {job!r} has no data set yet; run: python -m producer sink "
                       f"--job {job} --wait (or --local)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    tmp_out = Path(tmp_name)
    try:
        with tempfile.TemporaryDirectory(prefix="fleet-export-") as work:
            tables = shard_tables(store, manifest, Path(work))
            if fmt == "parquet":
                os.close(fd)
                rows = _write_parquet(tables, tmp_out)
            else:
                with os.fdopen(fd, "wb") as fh:
                    rows = _write_lines(tables, fh, fmt, manifest)
        os.chmod(tmp_out, FILE_MODE)  # mkstemp made it 0600
        os.replace(tmp_out, out)
        fsync_dir(out.parent)
    finally:
        tmp_out.unlink(missing_ok=True)
    return {"job": job, "format": fmt, "out": str(out), "rows": rows,
            "complete": manifest["complete"]}
