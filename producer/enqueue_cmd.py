"""``fleet enqueue``: its flags and the run that reads the input, checks it
(producer/refusals.py), stages and enqueues it (producer/enqueue.py).

The flags are declared once, as the parameters of :func:`enqueue_command` (typer reads them
there); the job record's sampling options take the parameters of the same names
(:func:`producer.options.job_sampling`), and :func:`flag_names` gives each parameter's flag to
the messages that name one and to the docs' table (tests/test_docs.py holds the table to it).
producer/cli.py registers the command wrapped in its one-line error handling.
"""

from __future__ import annotations

import inspect
from enum import Enum, StrEnum
from typing import Any

import typer

# --help groups the flags in panels: each panel's table is laid out on its own, so at 80
# columns no long flag name (--drop-unsupported-sampling) is cut to fit another's help.
SAMPLING, CHAT, ROWS, STORE = "Sampling", "Chat", "Input rows", "Store, reuse and quality"
QUALITY = "Quality warning"
INPUT_HELP = ("Prompts: a .jsonl[.gz] (prompt / messages / OpenAI-batch lines) or .parquet "
              "file, a folder of them, s3://bucket/key or s3://bucket/prefix/ of parts, or "
              "another fsspec URL (its filesystem package installed)")


class QualityReaction(StrEnum):
    """``--on-quality-warning``: what a failing live gate does to the job."""

    warn = "warn"
    pause = "pause"


def _reaction(value: Any) -> str | None:
    return value.value if isinstance(value, Enum) else value


def enqueue_command(
    input: str = typer.Argument(..., help=INPUT_HELP),
    job: str = typer.Option(..., "--job", help="Job name; re-run with the same name to resume"),
    batch_size: int = typer.Option(None, "--batch-size", min=1,
                                   help="Prompts per batch, fixed per job (default: "
                                   "FLEET_BATCH_SIZE's 500 or 4 x the live GPUs' in-flight "
                                   "budget, cut so every live GPU gets 2+ batches)"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", min=1, metavar="N",
                                       rich_help_panel=SAMPLING,
                                       help="Ceiling on generated tokens per prompt: a row's "
                                       "own max_tokens applies only when it is lower "
                                       "(requeue-failed --max-new-tokens lifts it)"),
    temperature: float = typer.Option(None, "--temperature", min=0.0, metavar="T",
                                      rich_help_panel=SAMPLING, help="Sampling temperature"),
    top_p: float = typer.Option(None, "--top-p", min=0.0, max=1.0, metavar="P",
                                rich_help_panel=SAMPLING, help="Nucleus sampling"),
    sampling: list[str] = typer.Option(None, "--sampling", metavar="KEY=VALUE",
                                       rich_help_panel=SAMPLING,
                                       help="Any SGLang sampling parameter, repeatable "
                                       "(top_k=20, min_p=0, stop='[\"END\"]'); values are "
                                       "JSON when they parse; OpenAI names (seed, max_tokens) "
                                       "are mapped. A row's own parameters override these"),
    chat: bool = typer.Option(False, "--chat", rich_help_panel=CHAT,
                              help="Send plain prompts as one user message "
                              "through the chat template instead of raw /generate text"),
    system_prompt: str = typer.Option(None, "--system-prompt", rich_help_panel=CHAT,
                                      help="System message for chat requests that have none "
                                      "of their own (implies --chat)"),
    chat_template_kwargs: str = typer.Option(None, "--chat-template-kwargs", metavar="JSON",
                                             rich_help_panel=CHAT,
                                             help="e.g. '{\"enable_thinking\": false}' "
                                             "(implies --chat; a row's own keys win)"),
    drop_unsupported: bool = typer.Option(False, "--drop-unsupported-sampling",
                                          rich_help_panel=ROWS,
                                          help="Drop row parameters the engine would refuse "
                                          "(counted in the job record) instead of refusing "
                                          "the input"),
    prompt_column: str = typer.Option("prompt", "--prompt-column", rich_help_panel=ROWS,
                                      help="Column of prompts"),
    messages_column: str = typer.Option("messages", "--messages-column", rich_help_panel=ROWS,
                                        help="Column of chat messages"),
    id_column: str = typer.Option("id", "--id-column", rich_help_panel=ROWS,
                                  help="Column of row ids"),
    reuse_from: str = typer.Option(None, "--reuse-from", rich_help_panel=STORE,
                                   help="Copy finished rows of this job (same prompt, "
                                   "sampling and profile) instead of regenerating"),
    allow_node_local_store: bool = typer.Option(
        False, "--allow-node-local-store", rich_help_panel=STORE, help="Accept a store on this "
        "node (lost when the node is returned; same as FLEET_ALLOW_NODE_LOCAL_STORE=1)"),
    samples: int = typer.Option(None, "--samples", metavar="N", rich_help_panel=SAMPLING,
                                help="Samples per prompt (a row's own OpenAI n wins; same as "
                                "--sampling n=N); each is stored once, with its number in "
                                "the column 'sample'"),
    keep_columns: str = typer.Option(None, "--keep-columns", metavar="A,B", rich_help_panel=ROWS,
                                     help="Input columns carried into the data set and every "
                                     "export ('*': every column the fleet does not read)"),
    quality: list[str] = typer.Option(None, "--quality", metavar="KEY=VALUE",
                                      rich_help_panel=STORE,
                                      help="A quality gate of the job, repeatable (near_empty=1%"
                                      ", truncated=5%, near_empty_tokens=10; docs/output.md)"),
    allow_quarantine: bool = typer.Option(False, "--allow-quarantine", rich_help_panel=STORE,
                                          help="Enqueue even when more rows are quarantined at "
                                          "staging than the failed_or_quarantined gate allows"),
    on_quality_warning: QualityReaction = typer.Option(
        None, "--on-quality-warning", rich_help_panel=QUALITY,
        help="When the live tally first fails a gate: warn (default) or pause the job "
        "(running batches finish; fleet resume goes on)"),
) -> None:
    """Stage INPUT in the store and enqueue every batch that is not stored and has no
    message and no live run (re-run it to resume or repair a job)."""
    import redis
    from rich.console import Console

    from config.settings import load_settings
    from producer import render
    from producer.context_limit import context_limit
    from producer.enqueue import JobInput
    from producer.enqueue import enqueue as enqueue_job
    from producer.keep import KeepColumns, parse_keep
    from producer.options import dropped_note, job_quality, job_sampling, resumed_sampling
    from producer.readers import ReadOptions, read_rows
    from producer.reuse import answered_twin, reuse_hook
    from workers import app
    from workers.dataset.jobs import check_job_name, load_spec
    from workers.dataset.location import check_not_repointed, locate, require_off_node
    from workers.dataset.store import open_store
    from workers.delivery import batch_size as batch_size_rule
    from workers.delivery.sink_requests import trigger_if_complete
    from workers.errors import JobError

    settings = load_settings()
    gates = job_quality(settings.quality, quality)
    require_off_node(locate(settings.store_url, settings.s3.endpoint_url),
                     allow_node_local_store or settings.allow_node_local_store)
    store = open_store(settings.store_url, settings.s3)
    r = redis.Redis.from_url(settings.redis_url.get_secret_value())
    err = Console(stderr=True, highlight=False)
    check_job_name(job)
    check_not_repointed(r, job, store.url)
    # FLEET_PROFILE on enqueue: the job needs it (read now, recorded once the job is staged).
    needs = _needed_profile(settings.profile) if "profile" in settings.model_fields_set else None
    spec_sampling = resumed_sampling(store, job, job_sampling(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        sampling=sampling, chat=chat, system_prompt=system_prompt,
        chat_template_kwargs=chat_template_kwargs, drop_unsupported=drop_unsupported,
        samples=samples))
    opts = ReadOptions(prompt_column, messages_column, id_column, spec_sampling.chat,
                       spec_sampling.drop_unsupported, spec_sampling.params,
                       samples=spec_sampling.samples, temperature=spec_sampling.temperature)
    if keep_columns is None:  # a re-run reads the input as the job was created
        try:
            keep_columns = load_spec(store, job).keep_arg
        except JobError:
            keep_columns = None
    if (kept := parse_keep(keep_columns)) is not None:
        opts.keep = KeepColumns(kept, fleet_columns=opts.columns())
    rows = read_rows(input, opts, settings.s3)
    limit = context_limit(settings.profile, spec_sampling)
    with render.enqueue_progress(err) as on_batch:
        reuse, reused = reuse_hook(store, r, reuse_from, settings.profile)

        def hook(spec: Any) -> None:  # before any batch is sent, after nothing was refused
            if needs is not None:
                from workers.delivery import jobstate

                jobstate.record_profile(r, job, needs.name, needs.output_flags())
            if reuse is not None:
                reuse(spec)

        staged = JobInput(input, job, batch_size or None, spec_sampling, rows,
                          dropped_keys=opts.dropped, keep=opts.keep, quality=gates,
                          allow_quarantine=allow_quarantine,
                          on_quality_warning=_reaction(on_quality_warning),
                          mark=limit.mark if limit is not None else None)
        report = enqueue_job(store, r, app, staged, on_batch,
                             default_batch_size=settings.batch_size, before_reconcile=hook,
                             choose_size=batch_size_rule.chooser(r, settings))
    render.enqueue_summary(err, report)
    if note := dropped_note(report.spec.dropped_keys):
        err.print(note, soft_wrap=True)
    if reused:
        err.print(reused[0].summary(), soft_wrap=True)
    elif report.created and (twin := answered_twin(r, report.spec)):
        err.print(twin, soft_wrap=True)
    trigger_if_complete(r, app, report.spec, settings)


def flags_table() -> list[str]:
    """The docs' table of the flags (docs/sglang.md): flag, --help panel, help."""
    import typer.main

    command = typer.main.get_command(_app())
    rows = ["| flag | panel | what it does |", "| --- | --- | --- |"]
    for p in command.params:
        flag = next((o for o in p.opts if o.startswith("--")), p.name.upper())
        what = (getattr(p, "help", None) or "").replace("|", "\\|")
        rows.append(f"| `{flag}` | {getattr(p, 'rich_help_panel', None) or 'Options'} | {what} |")
    return rows


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(enqueue_command)
    return app


def flag_names() -> dict[str, str]:
    """Each parameter of :func:`enqueue_command` and its flag (``samples`` -> ``--samples``;
    the input argument as ``INPUT``)."""
    out = {}
    for name, p in inspect.signature(enqueue_command).parameters.items():
        decls = getattr(p.default, "param_decls", None) or ()
        flags = [d for d in decls if d.startswith("--")]
        out[name] = flags[0] if flags else name.upper()
    return out


def _needed_profile(name: str) -> Any:
    """The launch profile FLEET_PROFILE names, to be recorded as the one the job needs (its
    parsers); a worker whose engine runs other parsers hands its batches back
    (docs/recipes.md)."""
    from config.launch_profile import ProfileError, load_profile
    from workers.errors import JobError

    try:
        return load_profile(name)
    except ProfileError as exc:
        raise JobError(f"FLEET_PROFILE: {exc}") from None
