"""``fleet export --usable-only``: answered rows that fail a row-level quality gate are left out.

A row is judged as the sink and ``verify`` judged it (:func:`workers.dataset.quality.judge`,
with the job's options and thresholds and the row's own structured output from its staged
input); it is left out, into ``<out>.errors.jsonl`` with the figure as its ``bucket`` and what
that figure says as its ``error``, when it falls under a per-row figure whose gate is on
(near_empty, invalid, no_reasoning, markers, truncated). Failed and quarantined rows are left
out by every trainer export anyway.
"""

from __future__ import annotations

from typing import Any

from producer.exports.source import DataSet
from workers.dataset.quality import judge
from workers.dataset.quality_gates import FIGURES, PER_ROW, thresholds
from workers.dataset.quality_options import job_options


class RowGates:
    """The judge of :data:`producer.exports.source.Judge` for one data set."""

    def __init__(self, data: DataSet) -> None:
        limits = thresholds(data.spec.quality)
        self.options = job_options(data.spec, int(limits["near_empty_tokens"]))
        self.sent = data.requests
        # A gate set to 1 (100 %) is off: its rows are usable.
        self.gated = {n for n in PER_ROW if FIGURES[n].gate is not None and limits[n] < 1}

    def __call__(self, rec: dict[str, Any]) -> tuple[str, str] | None:
        """(figure, why) of the first row-level gate ``rec`` fails, or None."""
        staged = self.sent.row(int(rec["batch"]), int(rec["index"]))
        self.options.clear_rows()
        self.options.add_rows([staged.model_dump()])
        for flag in judge(rec, self.options).flags:
            if flag in self.gated:
                return flag, f"{flag}: {FIGURES[flag].about} (--usable-only)"
        return None
