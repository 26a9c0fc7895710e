"""``fleet export``: a job's data set in the shape its reader takes, one module per format.

:data:`FORMATS` declares each once (:class:`Format`): its writer, whether it leaves rows out
into ``<out>.errors.jsonl``, what its lines count and whether it needs the model's tokenizer.
Every export reads the committed data set through :class:`.source.DataSet` and accounts for
every row: ``ok + errors`` is the data set's rows.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producer.exports.source import DataSet, ExportRun, Tally, errors_path
from workers.dataset.store import Store
from workers.errors import JobError


@dataclass(frozen=True)
class Format:
    """One export format."""

    name: str
    # "module:function" of its writer, imported when used: (DataSet, out, ExportRun) -> Tally.
    writer: str
    # What it is, for --help.
    about: str
    # Failed and quarantined rows go to <out>.errors.jsonl (else they are in the output).
    errors_file: bool = False
    # What its lines are.
    unit: str = "rows"
    # Built with the model's tokenizer (--tokenizer).
    tokens: bool = False

    def write(self, data: DataSet, out: Path, run: ExportRun) -> Tally:
        """Write ``data`` to ``out``."""
        module, func = self.writer.split(":")
        writer: Callable[[DataSet, Path, ExportRun], Tally] = getattr(
            importlib.import_module(module), func)
        return writer(data, out, run)


FORMATS = {f.name: f for f in (
    Format("parquet", "producer.exports.plain:write_parquet", "the data set as it is"),
    Format("jsonl", "producer.exports.plain:write_jsonl", "the data set, one row per line"),
    Format("openai-batch", "producer.exports.openai_batch:write_openai_batch",
           "an OpenAI Batch output file", unit="lines (one per prompt)"),
    Format("specforge", "producer.exports.specforge:write_specforge",
           "SpecForge's pre-tokenized JSONL: the engine's own tokens", errors_file=True,
           tokens=True),
    Format("speculators", "producer.exports.speculators:write_speculators",
           "vLLM speculators' regeneration JSONL: the engine's own tokens", errors_file=True,
           tokens=True),
    Format("tokens", "producer.exports.tokens:write_tokens",
           "the training rows as Parquet", errors_file=True, tokens=True),
    Format("hf", "producer.exports.hf:write_hf",
           "a folder datasets.load_dataset opens, with a dataset card", errors_file=True),
)}
# The share of compared rows that may differ from the engine's ids before an export fails.
MAX_DIFFER = 0.02


def export(store: Store, job: str, fmt: str, out: Path, tokenizer: Path | None = None,
           *, usable_only: bool = False, license_id: str = "other",
           max_differ: float = MAX_DIFFER, input_turns: bool = False) -> dict[str, Any]:
    """Write the data set of ``job`` to ``out`` in ``fmt``; return what was written:
    ``lines`` (of the output), ``ok`` and ``errors`` (data-set rows; their sum is ``rows``).
    ``usable_only``: rows that fail a row-level quality gate go to the errors file too;
    ``input_turns``: the token formats supervise the input's own assistant turns too.
    A token export whose rows differ from the engine's past ``max_differ`` is written, and
    ``inexact`` says why, naming rows."""
    from producer.exports.training import default_tokenizer, inexact

    form = FORMATS.get(fmt)
    if form is None:
        raise JobError(f"unknown format {fmt!r} (use {', '.join(FORMATS)})")
    if tokenizer is not None and not form.tokens:
        raise JobError(f"--tokenizer applies to --format {', '.join(tokenizer_formats())} only")
    if input_turns and not form.tokens:
        raise JobError(f"--train-input-turns applies to --format "
                       f"{', '.join(tokenizer_formats())} only")
    if usable_only and not form.errors_file:
        raise JobError("--usable-only applies to --format "
                       + ", ".join(f.name for f in FORMATS.values() if f.errors_file))
    data = DataSet.open(store, job)
    run = ExportRun(license=license_id)
    if usable_only:
        from producer.exports.usable import RowGates

        run.judge = RowGates(data)
    if form.tokens:
        from producer.exports.engine_tokens import Checks, EngineTokens

        run.engine = EngineTokens(tokenizer or default_tokenizer(data), input_turns)
        run.checks = Checks()
    tally = form.write(data, out, run)
    if tally.rows != data.rows:
        raise JobError(f"export read {tally.rows} rows but the manifest counts {data.rows}")
    done = {"job": job, "format": fmt, "unit": form.unit, "out": str(out), "rows": tally.rows,
            "lines": tally.lines, "ok": tally.ok, "errors": tally.errors,
            "errors_file": str(errors_path(out)) if form.errors_file else None,
            "complete": data.manifest["complete"], "failed_gates": data.failed_gates(),
            **tally.extra}
    if form.tokens:
        done |= {"tokenizer": str(run.engine.path), **run.checks.report(),
                 "inexact": inexact(run.checks, max_differ)}
    return done


def tokenizer_formats() -> list[str]:
    """The formats built with the model's tokenizer."""
    return [f.name for f in FORMATS.values() if f.tokens]
