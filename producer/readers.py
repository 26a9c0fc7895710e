"""Read prompt data sets row by row: JSONL (optionally gzipped), Parquet, OpenAI-batch lines.

Every row becomes the dict it is staged as: the fields of :class:`workers.jobs.PromptRow` in
their order, those at their default left out (what ``PromptRow.model_dump(exclude_defaults=True)``
gives, built directly: a million rows through the model cost seconds), with the row's 0-based
position as ``index``. A row that is valid JSON but carries no usable prompt is kept with an
``error`` (it is quarantined, never dropped); a line that is not JSON at all stops the read with
an :class:`InputError` naming the file and line, since a corrupt file should not half-enqueue.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import orjson

from workers.errors import InputError

PROMPT_KEYS = ("prompt", "messages", "id", "custom_id", "body")
# OpenAI-batch body keys that are request plumbing, not generation parameters.
BODY_SKIP = ("messages", "prompt", "model", "stream")


def _params(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in BODY_SKIP}


def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return "each message needs 'role' and 'content'"
    return None


def normalize(obj: Any, index: int, where: str) -> dict[str, Any]:
    """Turn one decoded row into its staged dict (with ``error`` set if it cannot be used)."""
    if not isinstance(obj, dict):
        return {"index": index, "id": str(index), "error": f"{where}: row is not an object"}
    rid = obj.get("custom_id", obj.get("id"))
    rid = str(rid) if rid is not None else str(index)
    source, params = obj, {}
    if isinstance(obj.get("body"), dict):  # OpenAI batch line
        source, params = obj["body"], _params(obj["body"])
    prompt, messages = source.get("prompt"), source.get("messages")
    if messages is not None:
        problem = _check_messages(messages)
        if problem:
            return {"index": index, "id": rid, "error": f"{where}: {problem}"}
        row = {"index": index, "id": rid, "messages": messages}
    elif isinstance(prompt, str) and prompt.strip():
        row = {"index": index, "id": rid, "prompt": prompt}
    elif prompt is not None:
        return {"index": index, "id": rid,
                "error": f"{where}: 'prompt' must be a non-empty string"}
    else:
        return {"index": index, "id": rid, "error": f"{where}: no 'prompt' or 'messages'"}
    if params:
        row["params"] = params
    return row


def _open_text(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a JSONL file; blank lines are skipped, bad JSON raises InputError."""
    index = 0
    try:
        with _open_text(path) as fh:
            for line_no, line in enumerate(fh, start=1):
                if line.isspace():
                    continue
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    raise InputError(str(path), line_no, f"not valid JSON ({exc})") from exc
                yield normalize(obj, index, f"line {line_no}")
                index += 1
    except (OSError, EOFError) as exc:
        raise InputError(str(path), None, f"cannot read: {exc}") from exc


def read_parquet(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a Parquet file, streamed in record batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        columns = [c for c in pf.schema_arrow.names if c in PROMPT_KEYS]
        if not columns:
            raise InputError(str(path), None, "no 'prompt', 'messages' or 'body' column")
        index = 0
        for rb in pf.iter_batches(batch_size=8192, columns=columns):
            for obj in rb.to_pylist():
                obj = {k: v for k, v in obj.items() if v is not None}
                yield normalize(obj, index, f"row {index}")
                index += 1
    except (OSError, pa.ArrowException) as exc:
        raise InputError(str(path), None, f"cannot read Parquet: {exc}") from exc


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of any supported prompt file, chosen by its suffix."""
    if not path.exists():
        raise InputError(str(path), None, "no such file")
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".parquet":
        return read_parquet(path)
    if suffixes and (suffixes[-1] in (".jsonl", ".json", ".ndjson") or suffixes[-2:] in (
            [".jsonl", ".gz"], [".json", ".gz"])):
        return read_jsonl(path)
    raise InputError(str(path), None, "unsupported format (use .jsonl, .jsonl.gz or .parquet)")
