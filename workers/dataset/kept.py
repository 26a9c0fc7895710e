"""Kept input columns (``enqueue --keep-columns``) in the data set: their Arrow schema as the
job record holds it, and their values cast back to it when the sink writes a shard.

The schema travels as base64 of Arrow's IPC serialization (JSON-safe; no pickle). A column
whose JSONL values did not agree on one type is a string column of JSON text, marked with the
field metadata ``fleet: json``.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pyarrow as pa

JSON_TEXT = "json"


def encode_schema(schema: pa.Schema) -> str:
    """An Arrow schema as base64 of its IPC serialization."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def decode_schema(text: str | None) -> pa.Schema | None:
    """The schema :func:`encode_schema` wrote (None when there is none)."""
    if not text:
        return None
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def is_json_text(f: pa.Field) -> bool:
    """Whether a kept column holds JSON text (its values disagreed on a type)."""
    return (f.metadata or {}).get(b"fleet") == JSON_TEXT.encode()


def kept_array(f: pa.Field, values: list[Any]) -> pa.Array:
    """One kept column's values as an array of its type (JSON text where the values disagree;
    values JSON carried as text, such as timestamps or decimals, are cast back)."""
    if is_json_text(f):
        return pa.array([None if v is None else orjson.dumps(v).decode() for v in values],
                        pa.string())
    try:
        return pa.array(values, f.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return pa.array([None if v is None else str(v) for v in values]).cast(f.type)
