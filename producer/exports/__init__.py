"""``fleet export``: a job's data set in the shape its reader takes, one module per format.

``parquet`` and ``jsonl`` (:mod:`.plain`): the data set as it is; ``openai-batch``
(:mod:`.openai_batch`): an OpenAI Batch output file; ``specforge`` (:mod:`.specforge`):
SpecForge's conversation JSONL; ``tokens`` (:mod:`.tokens`): ``input_ids`` and ``loss_mask``
Parquet built with the model's tokenizer; ``hf`` (:mod:`.hf`): a folder that
``datasets.load_dataset`` opens. Every export reads the committed data set through
:class:`.source.DataSet` and accounts for every row: ``ok + errors`` is the data set's rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from producer.exports.source import DataSet, Tally, errors_path
from workers.dataset.store import Store
from workers.errors import JobError

FORMATS = ("parquet", "jsonl", "openai-batch", "specforge", "tokens", "hf")
# Formats that leave failed and quarantined rows out, in <out>.errors.jsonl.
WITH_ERRORS_FILE = ("specforge", "tokens", "hf")


def _write(data: DataSet, fmt: str, out: Path, tokenizer: Path | None) -> Tally:
    if fmt == "parquet":
        from producer.exports.plain import write_parquet
        return write_parquet(data, out)
    if fmt == "jsonl":
        from producer.exports.plain import write_jsonl
        return write_jsonl(data, out)
    if fmt == "openai-batch":
        from producer.exports.openai_batch import write_openai_batch
        return write_openai_batch(data, out)
    if fmt == "specforge":
        from producer.exports.specforge import write_specforge
        return write_specforge(data, out)
    if fmt == "tokens":
        from producer.exports.tokens import write_tokens
        return write_tokens(data, out, tokenizer)
    from producer.exports.hf import write_hf
    return write_hf(data, out)


def export(store: Store, job: str, fmt: str, out: Path,
           tokenizer: Path | None = None) -> dict[str, Any]:
    """Write the data set of ``job`` to ``out`` in ``fmt``; return what was written:
    ``lines`` (of the output), ``ok`` and ``errors`` (data-set rows; their sum is ``rows``)."""
    if fmt not in FORMATS:
        raise JobError(f"unknown format {fmt!r} (use {', '.join(FORMATS)})")
    if tokenizer is not None and fmt != "tokens":
        raise JobError("--tokenizer applies to --format tokens only")
    data = DataSet.open(store, job)
    tally = _write(data, fmt, out, tokenizer)
    if tally.rows != data.rows:
        raise JobError(f"export read {tally.rows} rows but the manifest counts {data.rows}")
    return {"job": job, "format": fmt, "out": str(out), "rows": tally.rows,
            "lines": tally.lines, "ok": tally.ok, "errors": tally.errors,
            "errors_file": str(errors_path(out)) if fmt in WITH_ERRORS_FILE else None,
            "complete": data.manifest["complete"], **tally.extra}
