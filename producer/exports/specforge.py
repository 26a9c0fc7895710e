"""``fleet export --format specforge``: JSONL that SpecForge's data pipeline reads as it is.

One line per (prompt, sample) that finished: ``{"id", "input_id", "sample", "conversations",
"tools"?, "finish_reason"}``. ``id`` is :func:`~producer.exports.conversation.content_id`
over the input and the sample; ``input_id`` the input's own id. Failed and quarantined rows
go to ``<out>.errors.jsonl`` with their reason; truncated rows (``finish_reason`` "length")
are training rows and say so in ``finish_reason``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from producer.exports.conversation import assistant_turn, content_id, input_messages, row_tools
from producer.exports.source import DataSet, Tally, atomic_file, error_file


def specforge_line(rec: dict[str, Any], sampling: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The SpecForge line of one answered data-set row (``sampling``: the job's)."""
    messages = input_messages(rec, sampling)
    tools = row_tools(rec)
    turn = assistant_turn(rec)
    sample = rec.get("sample") or 0
    line: dict[str, Any] = {"id": content_id(messages, tools, sample, turn),
                            "input_id": rec["id"], "sample": sample,
                            "conversations": [*messages, turn]}
    if tools:
        line["tools"] = tools
    line["finish_reason"] = rec.get("finish_reason")
    return line


def write_specforge(data: DataSet, out: Path) -> Tally:
    """Write the SpecForge JSONL of ``data`` to ``out`` (and its errors side file)."""
    tally = Tally()
    sampling = data.manifest["params"].get("sampling") or {}
    with atomic_file(out) as tmp, tmp.open("wb") as fh, error_file(out) as errors, \
            data.tables() as tables:
        for table in tables:
            for rec in table.to_pylist():
                if rec["status"] != "ok":
                    errors.add(rec)
                    continue
                fh.write(orjson.dumps(specforge_line(rec, sampling), default=str) + b"\n")
                tally.ok += 1
        tally.errors = errors.count
    tally.lines = tally.ok
    return tally
