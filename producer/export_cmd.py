"""``fleet export``: its flags and the run that writes a job's data set for its reader
(producer/exports/: one :class:`~producer.exports.Format` per format). producer/cli.py
registers :func:`export_command` wrapped in its one-line error handling.
"""

from __future__ import annotations

from pathlib import Path

import typer

from producer.exports import FORMATS, MAX_DIFFER


def _formats_help() -> str:
    return "; ".join(f"{f.name}: {f.about}" for f in FORMATS.values())


def export_command(
    job: str = typer.Option(..., "--job", help="Job name"),
    fmt: str = typer.Option("parquet", "--format", help=_formats_help()),
    out_path: Path = typer.Option(..., "--out", help="File to write (a folder for hf)"),
    tokenizer: Path | None = typer.Option(
        None, "--tokenizer", help="specforge, speculators, tokens: the model folder whose "
        "tokenizer and chat template the engine used (default: the job's launch-profile "
        "model folder)"),
    max_differ: float = typer.Option(
        MAX_DIFFER, "--max-differ", min=0.0, max=1.0, help="specforge, speculators, tokens: exit 1 "
        "when more than this share of rows differ from the engine's ids or prompt length"),
    license_id: str = typer.Option("other", "--license",
                                   help="hf: the dataset card's license (an SPDX id)"),
    usable_only: bool = typer.Option(
        False, "--usable-only", help="specforge, speculators, tokens, hf: also leave out, into "
        "the errors file with the reason, rows that fail a row-level quality gate "
        "(near_empty, invalid, no_reasoning, markers, truncated)"),
    input_turns: bool = typer.Option(
        False, "--train-input-turns", help="specforge, speculators, tokens: also supervise the "
        "input's own assistant turns (context the engine was sent, not its output)"),
) -> None:
    """Write a job's data set for its reader: the data set as it is (parquet, jsonl), an
    OpenAI Batch output file, or a drafter trainer's input (specforge, speculators, tokens,
    hf)."""
    from producer.cli import RET_FAILED, err, job_settings
    from producer.exports import export as export_job
    from workers.dataset.jobs import load_spec
    from workers.dataset.store import open_store

    settings = job_settings(job)
    store = open_store(settings.store_url, settings.s3)
    load_spec(store, job)  # "no job ...", not "no data set yet", for a job that is not there
    done = export_job(store, job, fmt, out_path, tokenizer, license_id=license_id,
                      max_differ=max_differ, usable_only=usable_only, input_turns=input_turns)
    for line in export_summary(done):
        err().print(line, soft_wrap=True)
    if done.get("inexact"):
        raise typer.Exit(RET_FAILED)


def export_summary(done: dict) -> list[str]:
    """The lines ``fleet export`` prints: what it wrote, and ``ok + errors = rows``; the
    verdict when the data set failed a gate; how its tokens compare with the engine's."""
    from workers.dataset.quality_gates import gate_line

    text = (f"wrote {done['lines']:,} {done['unit']} of job {done['job']} to {done['out']} "
            f"({done['format']})")
    if done["errors_file"]:
        text += f" and {done['errors']:,} to {done['errors_file']}"
    text += f"; ok {done['ok']:,} + errors {done['errors']:,} = {done['rows']:,} rows"
    lines = [text + ("" if done["complete"] else "; the data set is NOT complete")]
    if gates := done["failed_gates"]:
        lines.append("quality: this data set failed its gates at commit (fleet verify exits "
                     f"5): {'; '.join(gate_line(g) for g in gates)}")
    if "compared" in done:
        lines.append(f"tokens: {done['tokenizer']}: {done['differ']:,} of "
                     f"{done['compared']:,} rows compared with the engine's ids and prompt "
                     "length differ")
    if done.get("inexact"):
        lines.append(f"export is not exact: {done['inexact']}")
    return lines
