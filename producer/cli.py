"""``python -m producer``: enqueue a prompt data set, follow its progress, verify the results."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson
import redis
import typer
from rich.console import Console

from config.settings import Settings, load_settings
from producer import render
from producer.enqueue import enqueue as enqueue_job
from producer.readers import read_rows
from producer.status import job_status
from producer.verify import verify_job
from workers.errors import FleetError, InputError, JobError
from workers.jobs import SamplingSpec, check_job_name, load_spec
from workers.store import Store, open_store

RET_OK, RET_FAILED, RET_INPUT, RET_JOB, RET_CONNECT = 0, 1, 2, 3, 4

cli = typer.Typer(
    help="Batch generation on a fleet of GPU workers: enqueue prompts, watch, verify.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
err = Console(stderr=True, highlight=False)
out = Console(highlight=False)
F = TypeVar("F", bound=Callable[..., Any])


def friendly_errors(fn: F) -> F:
    """Turn the fleet's errors into one line on stderr and a named exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except InputError as exc:
            err.print(f"error: {exc}", soft_wrap=True)
            raise typer.Exit(RET_INPUT) from None
        except (JobError, FleetError) as exc:
            err.print(f"error: {exc}", soft_wrap=True)
            raise typer.Exit(RET_JOB) from None
        except redis.ConnectionError as exc:
            err.print(f"error: cannot reach Redis ({exc}); is FLEET_REDIS_URL right?",
                      soft_wrap=True)
            raise typer.Exit(RET_CONNECT) from None

    return wrapper  # type: ignore[return-value]


def _open(settings: Settings) -> tuple[Store, redis.Redis]:
    return (open_store(settings.store_url, settings.s3),
            redis.Redis.from_url(settings.redis_url.get_secret_value()))


@cli.command()
@friendly_errors
def enqueue(
    input: Path = typer.Argument(..., help="Prompt file: .jsonl[.gz] (prompt / messages / "
                                 "OpenAI-batch lines) or .parquet"),
    job: str = typer.Option(..., "--job", help="Job name; re-run with the same name to resume"),
    batch_size: int = typer.Option(None, "--batch-size", min=1,
                                   help="Prompts per batch (default 500, fixed per job)"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", min=1,
                                       help="Cap on generated tokens per prompt"),
    temperature: float = typer.Option(None, "--temperature", min=0.0, help="Sampling temperature"),
    top_p: float = typer.Option(None, "--top-p", min=0.0, max=1.0, help="Nucleus sampling"),
) -> None:
    """Stage INPUT in the store and enqueue every batch that is neither done nor pending."""
    from workers import app

    settings = load_settings()
    store, r = _open(settings)
    check_job_name(job)
    sampling = SamplingSpec(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    rows = read_rows(input)
    with render.enqueue_progress(err) as on_batch:
        report = enqueue_job(store, r, app, input, job, batch_size or None, sampling, rows,
                             on_batch, default_batch_size=settings.batch_size)
    render.enqueue_summary(err, report)


@cli.command()
@friendly_errors
def status(
    job: str = typer.Option(..., "--job", help="Job name"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
    watch: bool = typer.Option(False, "--watch", help="Redraw every few seconds until done"),
    interval_s: float = typer.Option(2.0, "--interval", help="Seconds between redraws"),
) -> None:
    """Progress, rate (requests/s, output tokens/s), ETA and the per-GPU view of a job."""
    settings = load_settings()
    store, r = _open(settings)
    spec = load_spec(store, job)
    if not watch:
        st = job_status(r, spec)
        if as_json:
            sys.stdout.write(orjson.dumps(st).decode() + "\n")
        else:
            out.print(render.status_table(st))
        return
    render.watch(out, lambda: job_status(r, spec), interval_s, as_json)


@cli.command()
@friendly_errors
def verify(
    job: str = typer.Option(..., "--job", help="Job name"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
) -> None:
    """Check from the result store alone that every prompt is there exactly once."""
    settings = load_settings()
    store = open_store(settings.store_url, settings.s3)
    report = verify_job(store, load_spec(store, job))
    if as_json:
        sys.stdout.write(orjson.dumps(report).decode() + "\n")
    else:
        out.print(render.verify_table(report))
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

    settings = load_settings()
    store, r = _open(settings)
    report = requeue_failed(store, r, app, load_spec(store, job), truncated, max_new_tokens)
    kind = "truncated" if truncated else "failed"
    err.print(f"requeued {report.rows} {kind} prompts in {report.batches} batches of job {job}")


def main() -> None:
    """Entry point of ``python -m producer``."""
    try:
        cli()
    except KeyboardInterrupt:
        sys.exit(130)
