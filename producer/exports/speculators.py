"""``fleet export --format speculators``: JSONL in vLLM speculators' own regeneration rows.

``speculators regenerate-responses`` writes one JSONL line per generated turn
(``speculators/cli/regenerate_responses.py::_sample_from_response``): ``id`` =
``{conversation}_gen{k}``, ``primary_id`` (the conversation), ``input_ids`` and ``loss_mask``
(the prompt's ids with mask 0, then the completion's with mask 1), ``text`` (the ids decoded
with every special token shown) and ``metadata``. Its ``prepare-data`` carries such rows
through unchanged (``data_generation/preprocessing.py::_passthrough_pretokenized``), so
``speculators prepare-data --data out.jsonl`` trains on the engine's own tokens
(:mod:`producer.exports.engine_tokens`). Here ``k`` is the sample, ``metadata`` holds the
input's id, the finish reason, the usage the engine reported, the job's sampling and whether
the answer is the engine's own ids, and the kept input columns go under ``columns``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from producer.exports.source import DataSet, ExportRun, Tally
from producer.exports.training import Row, write_jsonl_rows


def _line(row: Row, text: str, sampling: dict[str, Any]) -> dict[str, Any]:
    rec = row.rec
    return {"id": f"{row.primary_id}_gen{rec.get('sample') or 0}",
            "primary_id": row.primary_id, "input_ids": row.tokens.input_ids,
            "loss_mask": row.tokens.loss_mask, "text": text,
            "metadata": {
                "idx": rec["index"], "input_id": rec["id"], "sample": rec.get("sample") or 0,
                "finish_reason": rec.get("finish_reason"),
                "is_tool_call": bool(rec.get("tool_calls")),
                "usage": {"prompt_tokens": rec.get("prompt_tokens") or 0,
                          "completion_tokens": rec.get("completion_tokens") or 0},
                "sampling_params": sampling, "profile": rec.get("profile"),
                "engine_ids": row.tokens.engine_ids}}


def write_speculators(data: DataSet, out: Path, run: ExportRun) -> Tally:
    """Write the speculators JSONL of ``data`` to ``out`` (and its errors side file)."""
    sampling = data.sampling

    def lines(rows: list[Row]) -> list[dict[str, Any]]:
        texts = run.engine.decode([row.tokens.input_ids for row in rows])
        return [_line(row, text, sampling) for row, text in zip(rows, texts, strict=True)]

    return write_jsonl_rows(data, out, run, lines)
