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
from workers.dataset.jobs import check_job_name, load_spec
from workers.dataset.store import Store, open_store
from workers.errors import FleetError, InputError, JobError
from workers.tune.cli import app as tune_app

if TYPE_CHECKING:
    from rich.console import Console

RET_OK, RET_FAILED, RET_INPUT, RET_JOB, RET_CONNECT = 0, 1, 2, 3, 4
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


def _job_settings(job: str) -> Settings:
    """The settings, with the store the job was enqueued into (producer/job_store.py)."""
    from producer.job_store import for_job

    return for_job(load_settings(), job)


@cli.command()
@friendly_errors
def enqueue(
    input: str = typer.Argument(..., help="Prompts: a .jsonl[.gz] (prompt / messages / "
                                "OpenAI-batch lines) or .parquet file, a folder of them, "
                                "s3://bucket/key or s3://bucket/prefix/ of parts, or another "
                                "fsspec URL (its filesystem package installed)"),
    job: str = typer.Option(..., "--job", help="Job name; re-run with the same name to resume"),
    batch_size: int = typer.Option(None, "--batch-size", min=1,
                                   help="Prompts per batch (default 500, fixed per job)"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", min=1,
                                       help="Ceiling on generated tokens per prompt: a row's "
                                       "own max_tokens applies only when it is lower "
                                       "(requeue-failed --max-new-tokens lifts it)"),
    temperature: float = typer.Option(None, "--temperature", min=0.0, help="Sampling temperature"),
    top_p: float = typer.Option(None, "--top-p", min=0.0, max=1.0, help="Nucleus sampling"),
    sampling: list[str] = typer.Option(None, "--sampling", metavar="KEY=VALUE",
                                       help="Any SGLang sampling parameter, repeatable "
                                       "(top_k=20, min_p=0, stop='[\"END\"]'); values are "
                                       "JSON when they parse; OpenAI names (seed, max_tokens) "
                                       "are mapped. A row's own parameters override these"),
    chat: bool = typer.Option(False, "--chat", help="Send plain prompts as one user message "
                              "through the chat template instead of raw /generate text"),
    system_prompt: str = typer.Option(None, "--system-prompt", help="System message for chat "
                                      "requests that have none of their own (implies --chat)"),
    chat_template_kwargs: str = typer.Option(None, "--chat-template-kwargs", metavar="JSON",
                                             help="e.g. '{\"enable_thinking\": false}' "
                                             "(implies --chat; a row's own keys win)"),
    drop_unsupported: bool = typer.Option(False, "--drop-unsupported-sampling",
                                          help="Drop row parameters the engine would refuse "
                                          "(counted in the job record) instead of refusing "
                                          "the input"),
    prompt_column: str = typer.Option("prompt", "--prompt-column", help="Column of prompts"),
    messages_column: str = typer.Option("messages", "--messages-column",
                                        help="Column of chat messages"),
    id_column: str = typer.Option("id", "--id-column", help="Column of row ids"),
    reuse_from: str = typer.Option(None, "--reuse-from", help="Copy finished rows of this job "
                                   "(same prompt, sampling and profile) instead of regenerating"),
    allow_node_local_store: bool = typer.Option(
        False, "--allow-node-local-store", help="Accept a store on this node (lost when the "
        "node is returned; same as FLEET_ALLOW_NODE_LOCAL_STORE=1)"),
    samples: int = typer.Option(None, "--samples", metavar="N",
                                help="Samples per prompt (a row's own OpenAI n wins; same as "
                                "--sampling n=N); each is stored once, with its number in "
                                "the column 'sample'"),
    keep_columns: str = typer.Option(None, "--keep-columns", metavar="A,B",
                                     help="Input columns carried into the data set and every "
                                     "export ('*': every column the fleet does not read)"),
) -> None:
    """Stage INPUT in the store and enqueue every batch that is not stored and has no
    message and no live run (re-run it to resume or repair a job)."""
    from producer import render
    from producer.enqueue import enqueue as enqueue_job
    from producer.keep import KeepColumns, parse_keep
    from producer.options import dropped_note, job_sampling, resumed_sampling
    from producer.readers import ReadOptions, read_rows
    from producer.reuse import reuse_hook
    from workers import app
    from workers.dataset.location import locate, require_off_node
    from workers.sink_task import trigger_if_complete

    settings = load_settings()
    require_off_node(locate(settings.store_url, settings.s3.endpoint_url),
                     allow_node_local_store or settings.allow_node_local_store)
    store, r = _open(settings)
    check_job_name(job)
    spec_sampling = resumed_sampling(store, job, job_sampling(
        max_new_tokens, temperature, top_p, sampling, chat, system_prompt, chat_template_kwargs,
        drop_unsupported, samples))
    opts = ReadOptions(prompt_column, messages_column, id_column, spec_sampling.chat,
                       spec_sampling.drop_unsupported, spec_sampling.params,
                       samples=spec_sampling.samples, temperature=spec_sampling.temperature)
    if keep_columns is None:  # a re-run reads the input as the job was created
        keep_columns = _recorded_keep(store, job)
    if (kept := parse_keep(keep_columns)) is not None:
        opts.keep = KeepColumns(kept, fleet_columns=opts.columns())
    rows = read_rows(input, opts, settings.s3)
    with render.enqueue_progress(err()) as on_batch:
        hook, reused = reuse_hook(store, r, reuse_from, settings.profile)
        report = enqueue_job(store, r, app, input, job, batch_size or None, spec_sampling, rows,
                             on_batch, default_batch_size=settings.batch_size,
                             before_reconcile=hook, dropped_keys=opts.dropped,
                             keep=opts.keep)
    render.enqueue_summary(err(), report)
    if note := dropped_note(report.spec.dropped_keys):
        err().print(note, soft_wrap=True)
    if reused:
        err().print(reused[0].summary(), soft_wrap=True)
    trigger_if_complete(r, app, report.spec, settings)


def _recorded_keep(store: Store, job: str) -> str | None:
    """The --keep-columns an existing job was created with (None: none, or no such job)."""
    try:
        return load_spec(store, job).keep_arg
    except JobError:
        return None


@cli.command()
@friendly_errors
def status(
    job: str = typer.Option(..., "--job", help="Job name"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
    watch: bool = typer.Option(False, "--watch", help="Redraw every few seconds until done"),
    interval_s: float = typer.Option(2.0, "--interval", help="Seconds between redraws"),
) -> None:
    """Progress, rate (requests/s, output tokens/s), ETA and the per-GPU view of a job."""
    from producer.status import job_status
    from workers.dataset.location import locate

    settings = _job_settings(job)
    store, r = _open(settings)
    spec = load_spec(store, job)
    where = locate(settings.store_url, settings.s3.endpoint_url)
    if as_json and not watch:
        sys.stdout.write(orjson.dumps(job_status(r, spec, where)).decode() + "\n")
        return
    from producer import render

    if watch:
        render.watch(out(), lambda: job_status(r, spec, where), interval_s, as_json)
    else:
        out().print(render.status_table(job_status(r, spec, where)))
        err().print(f"store: {where.store_url} ({where.where}: {where.why})", soft_wrap=True)


@cli.command()
@friendly_errors
def verify(
    job: str = typer.Option(..., "--job", help="Job name"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
) -> None:
    """Check from the result store alone that every prompt is there exactly once."""
    from producer.verify import verify_job

    settings = _job_settings(job)
    store = open_store(settings.store_url, settings.s3)
    report = verify_job(store, load_spec(store, job))
    if as_json:
        sys.stdout.write(orjson.dumps(report).decode() + "\n")
    else:
        from producer import render

        out().print(render.verify_table(report))
    if not report["ok"]:
        raise typer.Exit(RET_FAILED)


@cli.command("requeue-failed")
@friendly_errors
def requeue_failed_cmd(
    job: str = typer.Option(..., "--job", help="Job name"),
    truncated: bool = typer.Option(False, "--truncated",
                                   help="Redo rows cut at max_new_tokens, not failed ones"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", min=1,
                                       help="New token cap for the requeued prompts"),
) -> None:
    """Send quarantined (or, with --truncated, length-capped) prompts back to the GPUs."""
    from producer.requeue import requeue_failed
    from workers import app

    settings = _job_settings(job)
    store, r = _open(settings)
    report = requeue_failed(store, r, app, load_spec(store, job), truncated, max_new_tokens)
    kind = "truncated" if truncated else "failed"
    err().print(f"requeued {report.rows} {kind} prompts in {report.batches} batches of job {job}")


@cli.command()
@friendly_errors
def sink(
    job: str = typer.Option(..., "--job", help="Job name"),
    wait: bool = typer.Option(False, "--wait", help="Wait for the sink worker to finish"),
    local: bool = typer.Option(False, "--local", help="Aggregate in this process instead"),
    timeout_s: float = typer.Option(1800.0, "--timeout", help="Seconds --wait waits"),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object"),
) -> None:
    """Aggregate results into Parquet shards + manifest.json (+ _SUCCESS when verify passes)."""
    from producer.sinkcmd import run_sink

    settings = _job_settings(job)
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

    sys.stdout.write(dataset_path(_job_settings(job), job, allow_incomplete) + "\n")


@cli.command()
@friendly_errors
def export(
    job: str = typer.Option(..., "--job", help="Job name"),
    fmt: str = typer.Option("parquet", "--format", help="parquet, jsonl or openai-batch"),
    out_path: Path = typer.Option(..., "--out", help="File to write"),
) -> None:
    """Write a job's aggregated data set to one file (Parquet, JSONL or OpenAI-batch output)."""
    from producer.export import export as export_job

    settings = _job_settings(job)
    store = open_store(settings.store_url, settings.s3)
    load_spec(store, job)  # "no job ...", not "no data set yet", for a job that is not there
    done = export_job(store, job, fmt, out_path)
    err().print(f"wrote {done['rows']:,} rows of job {job} to {out_path} ({fmt})"
                + ("" if done["complete"] else "; the data set is NOT complete"), soft_wrap=True)


@cli.command()
@friendly_errors
def pause(job: str = typer.Option(..., "--job", help="Job name")) -> None:
    """Stop taking new batches of a job (running batches finish); undo with resume."""
    from producer.control import stop_job

    settings = load_settings()
    _, r = _open(settings)
    removed = stop_job(r, job, "paused")
    err().print(f"job {job} paused: {removed} queued batches pulled; running batches finish")


@cli.command()
@friendly_errors
def resume(job: str = typer.Option(..., "--job", help="Job name")) -> None:
    """Resume a paused (or cancelled) job: enqueue every batch that is not stored and has no
    message and no live run."""
    from producer.control import resume_job
    from workers import app

    settings = _job_settings(job)
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
    err().print(f"job {job} cancelled: {removed} queued batches removed; running batches stop")


@cli.command()
@friendly_errors
def jobs(as_json: bool = typer.Option(False, "--json", help="Print JSON")) -> None:
    """List the jobs Redis knows, with state and progress."""
    from workers.delivery.job_progress import list_jobs

    settings = load_settings()
    _, r = _open(settings)
    rows = list_jobs(r)
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

    settings = _job_settings(job)
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
