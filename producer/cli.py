"""``fleet`` (also ``python -m producer``): enqueue a prompt data set, follow its progress,
verify the results; ``fleet tune ...`` is the tuner (workers/tune/cli.py).

Each command imports what it needs when it runs (rich only to draw, Celery only where messages
are sent): ``status --json`` is polled by scripts and pays only for settings, store and Redis.
"""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
import redis
import typer

from config.settings import Settings, load_settings
from producer.enqueue_cmd import enqueue_command
from producer.export_cmd import export_command
from workers.dataset.jobs import check_job_name, load_spec
from workers.dataset.store import Store, open_store
from workers.errors import FleetError, InputError, JobError
from workers.tune.cli import app as tune_app

if TYPE_CHECKING:
    from rich.console import Console

RET_OK, RET_FAILED, RET_INPUT, RET_JOB, RET_CONNECT, RET_QUALITY = 0, 1, 2, 3, 4, 5
# Columns of stdout when it is not a terminal: tables are drawn at their natural width.
PIPED_WIDTH = 1000

cli = typer.Typer(
    help="Batch generation on a fleet of GPU workers: enqueue prompts, watch, verify.",
    no_args_is_help=True, pretty_exceptions_enable=False,  # --install-completion: typer's
)
cli.add_typer(tune_app, name="tune")
F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def err() -> Console:
    """The console on stderr (messages and errors)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False)


@functools.cache
def out() -> Console:
    """The console on stdout (tables). Piped or redirected, it is as wide as its tables need
    (rich would cut them at 80 columns) unless COLUMNS says otherwise."""
    import os

    from rich.console import Console

    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, width=PIPED_WIDTH if wide else None)


def friendly_errors(fn: F) -> F:
    """Turn the fleet's errors into one line on stderr and a named exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            for name in ("job", "reuse_from"):  # every command checks its job names first
                if isinstance(kwargs.get(name), str):
                    check_job_name(kwargs[name])
            return fn(*args, **kwargs)
        except InputError as exc:
            err().print(f"error: {exc}", soft_wrap=True)
            raise typer.Exit(RET_INPUT) from None
        except (JobError, FleetError) as exc:
            err().print(f"error: {exc}", soft_wrap=True)
            raise typer.Exit(RET_JOB) from None
        except redis.ConnectionError as exc:
            err().print(f"error: cannot reach Redis ({exc}); is FLEET_REDIS_URL right?",
                        soft_wrap=True)
            raise typer.Exit(RET_CONNECT) from None

    return wrapper  # type: ignore[return-value]


def _open(settings: Settings) -> tuple[Store, redis.Redis]:
    return (open_store(settings.store_url, settings.s3),
            redis.Redis.from_url(settings.redis_url.get_secret_value()))


def job_settings(job: str) -> Settings:
    """The settings, with the store the job was enqueued into (workers/dataset/location.py)."""
    from workers.dataset.location import for_job

    return for_job(load_settings(), job)


cli.command("enqueue")(friendly_errors(enqueue_command))
cli.command("export")(friendly_errors(export_command))


@cli.command()
@friendly_errors
def status(
    job: str = typer.Option(..., "--job", help="Job name"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
    watch: bool = typer.Option(False, "--watch", help="Redraw every few seconds until done"),
    interval_s: float = typer.Option(2.0, "--interval", help="Seconds between redraws"),
) -> None:
    """Progress, rate (requests/s, output tokens/s), ETA and the per-GPU view of a job."""
    from producer.status import job_status, status_spec
    from workers.dataset.location import locate

    settings = job_settings(job)
    store, r = _open(settings)
    spec = status_spec(store, r, job)
    where = locate(settings.store_url, settings.s3.endpoint_url)
    early = settings.quality_early_rows
    if as_json and not watch:
        sys.stdout.write(orjson.dumps(job_status(r, spec, where, early)).decode() + "\n")
        return
    from producer import render

    if watch:
        render.watch(out(), lambda: job_status(r, spec, where, early), interval_s, as_json)
    else:
        st = job_status(r, spec, where, early)
        out().print(render.status_table(st))
        if line := render.quality_note(st):
            err().print(line, soft_wrap=True)
        err().print(f"store: {where.store_url} ({where.where}: {where.why})", soft_wrap=True)


@cli.command()
@friendly_errors
def verify(
    job: str = typer.Option(..., "--job", help="Job name"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
    quality: list[str] = typer.Option(None, "--quality", metavar="KEY=VALUE",
                                      help="Override a quality gate of the job (near_empty=2%"
                                      ", truncated=0.1; docs/output.md)"),
) -> None:
    """Check from the result store alone that every prompt is there exactly once (exit 1 if
    not), and that the rows pass the job's quality gates (exit 5 if not)."""
    from producer.verify import verify_job
    from workers.dataset.quality_gates import parse_quality

    override = parse_quality(quality)
    settings = job_settings(job)
    store = open_store(settings.store_url, settings.s3)
    report = verify_job(store, load_spec(store, job), override)
    from producer import render

    if as_json:
        sys.stdout.write(orjson.dumps(report).decode() + "\n")
    else:
        out().print(render.verify_table(report))
    for line in render.quality_lines(report):
        err().print(line, soft_wrap=True)
    if not report["ok"]:
        raise typer.Exit(RET_FAILED)
    if not report["quality"]["ok"]:
        raise typer.Exit(RET_QUALITY)


@cli.command()
@friendly_errors
def requeue(
    job: str = typer.Option(..., "--job", help="Job name"),
    where: str = typer.Option(..., "--where", metavar="FIGURES",
                              help="Per-row quality figures whose rows are generated again, "
                              "comma-separated: near_empty, invalid, no_reasoning, markers, "
                              "truncated, failed, quarantined"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", min=1,
                                       help="New token cap for the requeued prompts"),
) -> None:
    """Generate the rows a quality figure names once more; the sink writes the data set's
    next version when they are stored (the other rows are kept as they are)."""
    from producer.requeue import parse_where
    from producer.requeue import requeue as requeue_rows
    from workers import app

    names = parse_where(where)
    settings = job_settings(job)
    store, r = _open(settings)
    report = requeue_rows(store, r, app, load_spec(store, job), names, max_new_tokens)
    _requeued(job, report)


def _requeued(job: str, report: Any) -> None:
    if not report.rows:
        err().print(f"job {job}: no row to requeue")
        return
    from producer.render import plural

    by = ", ".join(f"{n} {c:,}" for n, c in sorted(report.by.items()))
    err().print(f"requeued {plural(report.rows, 'row')} ({by}) in "
                f"{plural(report.batches, 'batch')} of job {job}; the data set's next version "
                "is written when they are stored")


@cli.command("requeue-failed")
@friendly_errors
def requeue_failed_cmd(
    job: str = typer.Option(..., "--job", help="Job name"),
    truncated: bool = typer.Option(False, "--truncated",
                                   help="Redo rows cut at max_new_tokens, not failed ones"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", min=1,
                                       help="New token cap for the requeued prompts"),
) -> None:
    """Send failed and quarantined (or, with --truncated, length-capped) prompts back to the
    GPUs: requeue --where failed,quarantined (or --where truncated)."""
    from producer.requeue import requeue_failed
    from workers import app

    settings = job_settings(job)
    store, r = _open(settings)
    report = requeue_failed(store, r, app, load_spec(store, job), truncated, max_new_tokens)
    _requeued(job, report)


@cli.command()
@friendly_errors
def sink(
    job: str = typer.Option(..., "--job", help="Job name"),
    wait: bool = typer.Option(False, "--wait", help="Wait for the run to finish"),
    local: bool = typer.Option(False, "--local", help="Aggregate in this process instead"),
    timeout_s: float = typer.Option(1800.0, "--timeout", help="Seconds --wait waits"),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object"),
) -> None:
    """Aggregate results into Parquet shards + manifest.json (+ _SUCCESS when verify passes)."""
    from producer.sinkcmd import run_sink

    settings = job_settings(job)
    summary = run_sink(settings, job, wait, local, timeout_s)
    if summary is None:
        err().print(f"sink of job {job} enqueued on queue 'sink'")
        return
    if as_json:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    else:
        err().print(f"job {job}: {summary['rows']:,} rows in {summary['shards']} shards "
                    f"({summary['bytes']:,} bytes), complete={summary['complete']}, "
                    f"manifest {settings.store_url}/{summary['manifest']}", soft_wrap=True)
    if not summary["complete"]:
        raise typer.Exit(RET_FAILED)


@cli.command("dataset-path")
@friendly_errors
def dataset_path_cmd(
    job: str = typer.Option(..., "--job", help="Job name"),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete",
                                          help="Print it even if rows are missing"),
) -> None:
    """Print the folder (or s3:// URL) of the job's committed data set: read it through this."""
    from producer.sinkcmd import dataset_path

    sys.stdout.write(dataset_path(job_settings(job), job, allow_incomplete) + "\n")


@cli.command()
@friendly_errors
def pause(job: str = typer.Option(..., "--job", help="Job name")) -> None:
    """Stop taking new batches of a job (running batches finish); undo with resume."""
    from producer.control import stop_job

    settings = load_settings()
    _, r = _open(settings)
    removed = stop_job(r, job, "paused")
    from producer.render import plural

    err().print(f"job {job} paused: {plural(removed, 'queued batch')} pulled; running batches "
                "finish")


@cli.command()
@friendly_errors
def resume(job: str = typer.Option(..., "--job", help="Job name")) -> None:
    """Resume a paused (or cancelled) job: enqueue every batch that is not stored and has no
    message and no live run."""
    from producer.control import resume_job
    from workers import app

    settings = job_settings(job)
    store, r = _open(settings)
    report = resume_job(store, r, app, load_spec(store, job))
    err().print(f"job {job} resumed: enqueued {report.enqueued}, already done "
                f"{report.already_done}, already pending {report.already_pending}")


@cli.command()
@friendly_errors
def cancel(job: str = typer.Option(..., "--job", help="Job name")) -> None:
    """Cancel a job: queued batches are removed and running ones stop within a second."""
    from producer.control import stop_job

    settings = load_settings()
    _, r = _open(settings)
    removed = stop_job(r, job, "cancelled")
    from producer.render import plural

    err().print(f"job {job} cancelled: {plural(removed, 'queued batch')} removed; running "
                "batches stop")


@cli.command()
@friendly_errors
def jobs(as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """List the jobs Redis knows, with state and progress."""
    from workers.delivery.job_progress import list_jobs

    settings = load_settings()
    _, r = _open(settings)
    rows = list_jobs(r, settings.quality_early_rows)
    if as_json:
        sys.stdout.write(orjson.dumps(rows).decode() + "\n")
    else:
        from producer import render

        out().print(render.jobs_table(rows))


@cli.command()
@friendly_errors
def report(
    job: str = typer.Option(..., "--job", help="Job name"),
    out_dir: Path = typer.Option(..., "--out", help="Folder for report.md, summary.json, PNGs"),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object"),
) -> None:
    """Write a report with plots: tokens/s per GPU, progress vs ETA, latency, finish reasons."""
    from producer.report import build_report

    settings = job_settings(job)
    store, r = _open(settings)
    summary = build_report(r, store, load_spec(store, job), out_dir)
    if as_json:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    else:
        err().print(f"report of job {job}: {out_dir / 'report.md'} "
                    f"({len(summary['files']) - 1} plots)", soft_wrap=True)


def main() -> None:
    """Entry point of ``fleet`` and ``python -m producer``."""
    # What is imported by now lives until exit: kept out of the collector, it is not scanned
    # by every full collection, nor by the one at interpreter exit (~30 ms of status --json).
    gc.freeze()
    try:
        cli()
    except KeyboardInterrupt:
        sys.exit(130)
