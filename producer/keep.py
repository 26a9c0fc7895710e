"""``enqueue --keep-columns``: input columns carried into the data set and every export.

The kept values of a row are staged once per prompt (``PromptRow.keep``), whatever its number
of samples, and copied into each of its result rows. Their types are recorded in the job
record (``JobSpec.keep_columns``, and the Arrow schema itself as base64 IPC in
``keep_schema``): a Parquet input's columns keep their Arrow types; JSONL keys become typed
columns where every row's value agrees (booleans, integers, numbers, strings), and JSON text
where they do not (or where the values are lists or objects).

A kept column may not take the name of one of the fleet's own data-set columns
(:func:`reserved_columns`): that is refused at ``enqueue`` with one line naming it.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from workers.dataset.kept import JSON_TEXT, encode_schema
from workers.errors import InputError

ALL = "*"
# JSON kinds of JSONL values, and the Arrow type a column of one kind gets.
_KIND_TYPES = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(),
               "str": pa.string()}


def reserved_columns() -> frozenset[str]:
    """The data set's own column names (a kept column may not take one)."""
    from workers.dataset.manifest import SCHEMA

    return frozenset(SCHEMA.names)


def parse_keep(raw: str | None) -> list[str] | None:
    """``--keep-columns a,b`` or ``'*'`` as a list (None when not given); InputError naming a
    column that collides with one of the fleet's own."""
    if raw is None:
        return None
    names = [c.strip() for c in raw.split(",") if c.strip()]
    if not names:
        raise InputError("--keep-columns", None, "names no column")
    if ALL in names and len(names) > 1:
        raise InputError("--keep-columns", None, "'*' keeps every column; give it alone")
    for name in names:
        check_not_reserved(name)
    return names


def check_not_reserved(name: str) -> None:
    """InputError naming ``name`` when it is one of the fleet's own data-set columns."""
    if name in reserved_columns():
        raise InputError("--keep-columns", None, f"column {name!r} collides with the "
                         f"fleet's own data-set column {name!r}; rename it in the input")


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "other"


def _jsonable(value: Any) -> Any:
    """A Parquet value as JSON can carry it (the sink casts it back to the column's type)."""
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


@dataclass
class KeepColumns:
    """The kept columns of one ``enqueue`` run, and the types their values showed."""

    wanted: list[str]
    fleet_columns: tuple[str, ...] = ()
    arrow: dict[str, pa.DataType] = field(default_factory=dict)  # from a Parquet schema
    kinds: dict[str, set[str]] = field(default_factory=dict)  # JSON kinds seen (JSONL)
    order: list[str] = field(default_factory=list)

    @property
    def every(self) -> bool:
        """``--keep-columns '*'``."""
        return self.wanted == [ALL]

    def _note(self, name: str) -> None:
        if name not in self.order:
            check_not_reserved(name)
            self.order.append(name)
            self.kinds.setdefault(name, set())

    def names(self, available: Iterable[str], fleet: Iterable[str]) -> list[str]:
        """The kept names among ``available`` (for '*': every one the fleet does not read)."""
        if self.every:
            skip = set(fleet)
            return [c for c in available if c not in skip]
        return list(self.wanted)

    def parquet_schema(self, schema: pa.Schema, fleet: tuple[str, ...]) -> None:
        """Record the Arrow types of the kept columns of a Parquet part."""
        for name in self.names(schema.names, fleet):
            self._note(name)
            if name in schema.names:
                self.arrow.setdefault(name, schema.field(name).type)

    def take(self, obj: dict[str, Any]) -> dict[str, Any]:
        """A row's kept values (null for a column the row lacks)."""
        names = self.names(obj, self.fleet_columns) if self.every else self.wanted
        out: dict[str, Any] = {}
        for name in names:
            self._note(name)
            value = obj.get(name)
            if value is not None:
                self.kinds[name].add(_kind(value))
            out[name] = _jsonable(value)
        return out

    def column_type(self, name: str) -> pa.DataType | None:
        """The column's Arrow type (None: JSON text)."""
        if name in self.arrow:
            return self.arrow[name]
        kinds = self.kinds.get(name, set())
        if kinds == {"int", "float"}:
            return pa.float64()
        if len(kinds) == 1 and (only := next(iter(kinds))) in _KIND_TYPES:
            return _KIND_TYPES[only]
        if not kinds:
            return pa.string()  # null in every row
        return None

    def schema(self) -> pa.Schema:
        """The kept columns as Arrow fields (JSON text as strings, marked in the metadata)."""
        fields = []
        for name in self.order:
            t = self.column_type(name)
            meta = None if t is not None else {b"fleet": JSON_TEXT.encode()}
            fields.append(pa.field(name, t if t is not None else pa.string(), metadata=meta))
        return pa.schema(fields)

    def record(self) -> tuple[dict[str, str], str | None]:
        """(name -> type as text, the schema as base64 Arrow IPC) for the job record."""
        if not self.order:
            return {}, None
        schema = self.schema()
        types = {f.name: JSON_TEXT if (f.metadata or {}).get(b"fleet") else str(f.type)
                 for f in schema}
        return types, encode_schema(schema)
