"""The answered rows of a data set as training rows, batch by batch, for the token exports.

``specforge``, ``speculators`` and ``tokens`` write the same rows
(:mod:`producer.exports.engine_tokens`) in their readers' shapes. Each row is compared with
the engine's own ids and counts; past ``max_differ`` of the compared rows the export is not
exact, and says so naming rows (:func:`check_exact`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import orjson

from producer.exports.conversation import content_id, conversation, row_tools
from producer.exports.engine_tokens import Checks, EngineTokens, TrainingRow
from producer.exports.sent import Sent
from producer.exports.source import (
    DataSet,
    ErrorFile,
    ExportRun,
    Tally,
    atomic_file,
    error_file,
    kept_columns,
)
from workers.errors import JobError

# Rows tokenized together (one batched encode).
CHUNK = 512


@dataclass(frozen=True)
class Row:
    """One answered data-set row, the request it answered and its training row."""

    rec: dict[str, Any]
    sent: Sent
    tokens: TrainingRow

    @cached_property
    def conversation(self) -> list[dict[str, Any]]:
        """The messages the engine was sent, then the generated turn."""
        return conversation(self.sent, self.rec)

    @property
    def tools(self) -> list[Any] | None:
        """The tools the request carried."""
        return self.sent.tools or row_tools(self.rec)

    @cached_property
    def primary_id(self) -> str:
        """Content hash of the request (the samples of one prompt share it)."""
        return content_id(self.conversation[:-1], self.tools, -1)

    @property
    def id(self) -> str:
        """Content hash of the request, the sample and the answer."""
        conv = self.conversation
        return content_id(conv[:-1], self.tools, int(self.rec.get("sample") or 0), conv[-1])


def default_tokenizer(data: DataSet) -> Path:
    """The job's launch-profile model folder (the profile with the most rows first)."""
    for model in data.model_paths():
        if Path(model).is_dir():
            return Path(model)
    shown = ", ".join(data.model_paths()) or "none recorded"
    raise JobError(f"job {data.job!r}: its model ({shown}) is not a folder here; "
                   "pass --tokenizer PATH (the model's folder, or any folder with its "
                   "tokenizer.json, tokenizer_config.json and generation_config.json)")


def training_rows(data: DataSet, run: ExportRun, tables: Iterator[Any], errors: ErrorFile
                  ) -> Iterator[list[Row]]:
    """Chunks of training rows; rows no training row is made of go to ``errors``."""
    sent = data.requests
    engine: EngineTokens = run.engine
    checks: Checks = run.checks
    for table in tables:
        recs = errors.usable(table.to_pylist(), run.judge)
        for start in range(0, len(recs), CHUNK):
            chunk = recs[start:start + CHUNK]
            sents = [sent.get(rec) for rec in chunk]
            rows = [Row(rec, s, t) for rec, s, t in zip(chunk, sents, engine.rows(chunk, sents),
                                                        strict=True)]
            for row in rows:
                checks.add(str(row.rec["id"]), row.tokens,
                           bool(row.rec.get("prompt_tokens")) or row.tokens.engine_ids)
            yield rows


def write_jsonl_rows(data: DataSet, out: Path, run: ExportRun,
                     lines: Callable[[list[Row]], list[dict[str, Any]]]) -> Tally:
    """Write one JSONL line per training row (``lines`` shapes a chunk of them; the kept
    input columns go under ``columns``) and the errors side file."""
    tally = Tally()
    with atomic_file(out) as tmp, tmp.open("wb") as fh, error_file(out) as errors, \
            data.tables() as tables:
        for rows in training_rows(data, run, tables, errors):
            for row, line in zip(rows, lines(rows), strict=True):
                if kept := kept_columns(row.rec):
                    line["columns"] = kept
                fh.write(orjson.dumps(line, default=str) + b"\n")
            tally.ok += len(rows)
        tally.errors = errors.count
    tally.lines = tally.ok
    return tally


def inexact(checks: Checks, max_differ: float) -> str | None:
    """Why the export is not the engine's tokens, when more than ``max_differ`` of the
    compared rows differ from the engine's ids or counts (None otherwise)."""
    if not checks.compared or checks.differ <= max_differ * checks.compared:
        return None
    why = ", ".join(f"{n:,} {k}" for k, n in sorted(checks.reasons.items()))
    return (f"{checks.differ:,} of {checks.compared:,} rows differ from what the engine "
            f"reported ({why}; e.g. {', '.join(checks.named)}), above --max-differ "
            f"{max_differ:.1%}: is --tokenizer the job's model? (context: its length is not "
            "the engine's prompt_tokens; answer: the answer's text re-tokenized is not the "
            "engine's output_ids)")
