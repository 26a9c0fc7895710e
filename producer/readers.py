"""Read prompt data sets row by row: JSONL (optionally gzipped), Parquet, OpenAI-batch lines.

Every row becomes the dict it is staged as: the fields of :class:`workers.dataset.jobs.PromptRow` in
their order, those at their default left out (what ``PromptRow.model_dump(exclude_defaults=True)``
gives, built directly: a million rows through the model cost seconds), with the row's 0-based
position in the data set as ``index``. A row that is valid JSON but carries no usable prompt
(its prompt or messages column missing or of the wrong type) is kept with an ``error`` (it is
quarantined, never dropped); a line that is not JSON at all, or a sampling key the engine would
refuse, stops the read with an :class:`InputError` naming the file and line, since a corrupt
file should not half-enqueue.

Data sets can live anywhere :mod:`producer.sources` reaches (folders and prefixes of parts,
S3, fsspec URLs); the parts are read in name order as one sequence of rows.
"""

from __future__ import annotations

import gzip
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from config.settings import S3Settings
from producer.keep import KeepColumns
from producer.options import greedy_refusal
from producer.sources import Part, list_parts
from workers.dataset.samples import row_samples
from workers.engine.sampling import (
    CHAT_ONLY,
    LOGPROB_KEYS,
    OPENAI_NAMES,
    SAMPLING_PARAMS,
    SamplingError,
    check_row_params,
    translate,
)
from workers.errors import InputError

# OpenAI-batch body keys that are request plumbing, not generation parameters.
BODY_SKIP = ("messages", "prompt", "model", "stream")
# Request keys a plain (not OpenAI-batch) row may carry at its top level: sent as an
# OpenAI-batch body's are (tools, tool_choice, response_format, json_schema, ... ), never
# dropped without a word.
ROW_KEYS = frozenset(SAMPLING_PARAMS) | frozenset(OPENAI_NAMES) | frozenset(
    LOGPROB_KEYS) | frozenset(CHAT_ONLY)
# Rows read before the first is staged: when none of them has a prompt or messages column,
# the input is refused with the columns it does have.
PROBE_ROWS = 100


@dataclass
class ReadOptions:
    """How rows map onto prompts, and what to do with sampling keys the engine refuses."""

    prompt_column: str = "prompt"
    messages_column: str = "messages"
    id_column: str = "id"
    # --chat: plain prompts are sent as chat requests (decides which keys a row may carry).
    chat: bool = False
    # --drop-unsupported-sampling: leave such keys out (counted) instead of refusing the input.
    drop_unsupported: bool = False
    # The job's --sampling keys: checked against the chat route at the first chat row.
    job_params: dict[str, Any] = field(default_factory=dict)
    # Row parameter keys never sent, with how many rows carried each (filled while reading).
    dropped: Counter[str] = field(default_factory=Counter)
    # --samples N: the job's samples per prompt, and its temperature (N > 1 at temperature 0
    # is refused per row too, where a row's own n or temperature makes it so).
    samples: int = 1
    temperature: Any = None
    # --keep-columns (producer/keep.py): which input columns ride along, and their types.
    keep: KeepColumns | None = None
    # Rows without a prompt or messages column, and the columns such rows had (a few).
    missing_column_rows: int = 0
    seen_columns: list[str] = field(default_factory=list)
    _chat_checked: bool = field(default=False, init=False, repr=False)

    def check_chat_row(self) -> None:
        """The job's parameters must exist in a chat request too (SamplingError if not)."""
        if not self._chat_checked:
            try:
                translate(self.job_params, chat=True)
            except SamplingError as exc:  # a --sampling key: the drop flag is for rows' keys
                raise SamplingError(exc.key, f"(--sampling) {exc.reason}") from None
            self._chat_checked = True

    def columns(self) -> tuple[str, ...]:
        """Columns the fleet reads itself (a Parquet reader needs them)."""
        return (self.prompt_column, self.messages_column, self.id_column, "custom_id", "body")

    def check_samples(self, row: dict[str, Any]) -> None:
        """SamplingError for a row that asks for N > 1 samples at temperature 0."""
        params = row.get("params") or {}
        n = row_samples(params, self.samples)
        if n > 1 and ("n" in params or "temperature" in params):
            why = greedy_refusal(n, params.get("temperature", self.temperature))
            if why:
                raise SamplingError("n", f"asks for {why}")


def _check_messages(messages: Any, column: str) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"{column!r} must be a non-empty list"
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return "each message needs 'role' and 'content'"
    return None


def _params(body: dict[str, Any], chat: bool, opts: ReadOptions) -> dict[str, Any]:
    params = {k: v for k, v in body.items() if k not in BODY_SKIP}
    if not params:
        return params
    kept, dropped = check_row_params(params, chat, opts.drop_unsupported)
    opts.dropped.update(dropped)
    return kept


def _refused(exc: SamplingError, source: str, line: int | None, where: str = "") -> InputError:
    """The one line that refuses an input for a key the engine would reject."""
    hint = "; --drop-unsupported-sampling drops it" if exc.droppable else ""
    return InputError(source, line, f"{where}{exc}{hint}")


def _prompt_fields(src: dict[str, Any], opts: ReadOptions, body: bool) -> dict[str, Any] | str:
    """{"prompt": ...} or {"messages": ...}, or why the row has neither."""
    pcol, mcol = ("prompt", "messages") if body else (opts.prompt_column, opts.messages_column)
    prompt, messages = src.get(pcol), src.get(mcol)
    if messages is not None:
        return _check_messages(messages, mcol) or {"messages": messages}
    if isinstance(prompt, str) and prompt.strip():
        return {"prompt": prompt}
    if prompt is not None:
        return f"{pcol!r} must be a non-empty string"
    return f"no {pcol!r} or {mcol!r}"


def normalize(obj: Any, index: int, where: str, opts: ReadOptions | None = None
              ) -> dict[str, Any]:
    """Turn one decoded row into its staged dict (with ``error`` set if it cannot be used);
    SamplingError for a parameter the engine would refuse."""
    opts = opts or ReadOptions()
    if not isinstance(obj, dict):
        return {"index": index, "id": str(index), "error": f"{where}: row is not an object"}
    rid = obj.get("custom_id", obj.get(opts.id_column))
    rid = str(rid) if rid is not None else str(index)
    body = isinstance(obj.get("body"), dict)  # OpenAI batch line
    fields = _prompt_fields(obj["body"] if body else obj, opts, body)
    if isinstance(fields, str):
        if fields.startswith("no "):
            opts.missing_column_rows += 1
            if len(opts.seen_columns) < 50:
                opts.seen_columns += [k for k in obj if k not in opts.seen_columns]
        bad = {"index": index, "id": rid, "error": f"{where}: {fields}"}
        if opts.keep is not None:
            bad["keep"] = opts.keep.take(obj)
        return bad
    row = {"index": index, "id": rid, **fields}
    if "messages" in fields and opts.job_params:
        opts.check_chat_row()
    own = obj["body"] if body else {k: v for k, v in obj.items() if k in ROW_KEYS
                                    and k not in (opts.prompt_column, opts.messages_column,
                                                  opts.id_column)}
    if own:
        params = _params(own, opts.chat or "messages" in fields, opts)
        if params:
            row["params"] = params
    if opts.keep is not None:
        row["keep"] = opts.keep.take(obj)
    return row


def _text_stream(part: Part) -> IO[bytes]:
    raw = part.open()
    return gzip.GzipFile(fileobj=raw, mode="rb") if part.fmt == "jsonl.gz" else raw


def _not_json(line: bytes, offset: int, exc: orjson.JSONDecodeError) -> str:
    """Why a line is not JSON: its encoding when it is not UTF-8 (the byte and its offset in
    the file, uncompressed), else the parser's words."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as bad:
        return (f"not UTF-8: byte 0x{line[bad.start]:02x} at byte offset {offset + bad.start:,}"
                f" of the file (column {bad.start + 1} of the line); JSONL must be UTF-8 "
                "(re-encode it, e.g. iconv -f latin1 -t utf-8)")
    return f"not valid JSON ({exc})"


def read_jsonl(part: Part, opts: ReadOptions, start: int = 0) -> Iterator[dict[str, Any]]:
    """Rows of a JSONL part; blank lines are skipped, bad JSON (or a line that is not UTF-8)
    raises InputError."""
    index, offset = start, 0
    try:
        with _text_stream(part) as fh:
            for line_no, line in enumerate(fh, start=1):
                offset, at = offset + len(line), offset
                if line.isspace():
                    continue
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    raise InputError(part.name, line_no, _not_json(line, at, exc)) from None
                try:
                    row = normalize(obj, index, f"line {line_no}", opts)
                    opts.check_samples(row)
                    yield row
                except SamplingError as exc:
                    raise _refused(exc, part.name, line_no) from None
                index += 1
    except (OSError, EOFError) as exc:
        raise InputError(part.name, None, f"cannot read: {exc}") from exc


def read_parquet(part: Part, opts: ReadOptions, start: int = 0) -> Iterator[dict[str, Any]]:
    """Rows of a Parquet part, streamed in record batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with part.open() as fh:
            pf = pq.ParquetFile(fh)
            wanted = opts.columns()
            if opts.keep is not None:
                opts.keep.parquet_schema(pf.schema_arrow, wanted)
                wanted = wanted + tuple(opts.keep.names(pf.schema_arrow.names, wanted))
            columns = [c for c in pf.schema_arrow.names if c in wanted]
            if not set(columns) & {opts.prompt_column, opts.messages_column, "body"}:
                have = ", ".join(pf.schema_arrow.names)
                raise InputError(part.name, None, f"no {opts.prompt_column!r}, "
                                 f"{opts.messages_column!r} or 'body' column; its columns: "
                                 f"{have} (--prompt-column / --messages-column)")
            index = start
            for rb in pf.iter_batches(batch_size=8192, columns=columns):
                for obj in rb.to_pylist():
                    obj = {k: v for k, v in obj.items() if v is not None}
                    where = f"row {index - start}"
                    try:
                        row = normalize(obj, index, where, opts)
                        opts.check_samples(row)
                        yield row
                    except SamplingError as exc:
                        raise _refused(exc, part.name, None, f"{where}: ") from None
                    index += 1
    except (OSError, pa.ArrowException) as exc:
        raise InputError(part.name, None, f"cannot read Parquet: {exc}") from exc


def _read_parts(parts: list[Part], opts: ReadOptions) -> Iterator[dict[str, Any]]:
    index = 0
    for part in parts:
        reader = read_parquet if part.fmt == "parquet" else read_jsonl
        for row in reader(part, opts, index):
            yield row
            index += 1


def _probed(rows: Iterator[dict[str, Any]], opts: ReadOptions, source: str
            ) -> Iterator[dict[str, Any]]:
    """``rows``, the first PROBE_ROWS read before any is yielded: InputError, listing the
    columns the rows do have, when none of them has a prompt or messages column."""
    head = []
    opts.missing_column_rows, opts.seen_columns = 0, []
    for row in rows:
        head.append(row)
        if len(head) >= PROBE_ROWS:
            break
    if head and opts.missing_column_rows == len(head):
        have = ", ".join(opts.seen_columns) or "none"
        raise InputError(source, None, (
            f"no row has a {opts.prompt_column!r} or {opts.messages_column!r} column (nor an "
            f"OpenAI-batch 'body'); the rows have: {have} (--prompt-column / "
            "--messages-column)"))
    yield from head
    yield from rows


def read_rows(path: Path | str, opts: ReadOptions | None = None,
              s3: S3Settings | None = None) -> Iterator[dict[str, Any]]:
    """Rows of a prompt file, folder of parts, S3 object or prefix, or fsspec URL (the parts
    are listed now, so a missing input fails before anything is staged)."""
    opts = opts or ReadOptions()
    return _probed(_read_parts(list_parts(path, s3), opts), opts, str(path))
