"""``fleet export --format specforge``: JSONL that SpecForge's training reads as it is.

One line per (prompt, sample) that finished: ``{"id", "input_id", "sample", "input_ids",
"loss_mask", "conversations", "tools"?, "finish_reason", "columns"?}``. A file whose first
record carries ``input_ids`` and ``loss_mask`` is pre-tokenized to SpecForge: its training
entry point (``specforge/training/assembly.py::_prepare_prompts`` →
``specforge/data/prompt_builder.py::prepare_prompt_tasks``) takes each row's ids and mask as
they are, with no chat template applied, no system prompt added and no turn re-serialized:
the context the engine was sent and the tokens it generated
(:mod:`producer.exports.engine_tokens`). ``conversations`` (the messages as sent, then the
generated turn) and the kept input columns (``columns``) ride along for people; SpecForge
does not read them. Failed and quarantined rows go to ``<out>.errors.jsonl`` with their reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from producer.exports.source import DataSet, ExportRun, Tally
from producer.exports.training import Row, write_jsonl_rows


def _line(row: Row) -> dict[str, Any]:
    line = {"id": row.id, "input_id": row.rec["id"], "sample": row.rec.get("sample") or 0,
            "input_ids": row.tokens.input_ids, "loss_mask": row.tokens.loss_mask,
            "conversations": row.conversation}
    if row.tools:
        line["tools"] = row.tools
    line["finish_reason"] = row.rec.get("finish_reason")
    return line


def write_specforge(data: DataSet, out: Path, run: ExportRun) -> Tally:
    """Write the SpecForge JSONL of ``data`` to ``out`` (and its errors side file)."""
    return write_jsonl_rows(data, out, run, lambda rows: [_line(row) for row in rows])
