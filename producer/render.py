"""Terminal rendering for the producer CLI (rich tables, progress, the --watch loop)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import orjson
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from workers.delivery.job_progress import shown_state

if TYPE_CHECKING:
    from producer.enqueue import EnqueueReport


def plural(count: int, noun: str) -> str:
    """``1 batch``, ``2 batches``, ``1,000 rows``."""
    if count == 1:
        return f"1 {noun}"
    return f"{count:,} {noun}{'es' if noun.endswith(('s', 'sh', 'ch', 'x')) else 's'}"


@contextlib.contextmanager
def enqueue_progress(console: Console) -> Iterator[Callable[[int, int], None]]:
    """A progress line for staging on a terminal: rows read and batches written (piped, none:
    rich would leave an empty line where it stood)."""
    if not console.is_terminal:
        yield lambda rows, batches: None
        return
    # The row count is unknown while the file streams: the bar pulses instead of filling.
    columns = (SpinnerColumn(), BarColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("reading", total=None)

        def on_batch(rows: int, batches: int) -> None:
            progress.update(task, description=f"read {plural(rows, 'row')}, staged "
                                              f"{plural(batches, 'batch')}")

        yield on_batch


# Seconds the last view of a done job waits for engine readings taken after its end: a
# worker reads its engine once a heartbeat interval (5 s by default) and sends the reading
# with its next beat, up to another interval later.
SETTLE_WAIT_S = 12.0


def enqueue_summary(console: Console, report: EnqueueReport) -> None:
    """One paragraph on what enqueue did."""
    s = report.spec
    verb = "created" if report.created else "resumed"
    console.print(
        f"job {s.name} {verb}: {plural(s.total, 'prompt')} in {plural(s.n_batches, 'batch')} "
        f"of {s.batch_size}; "
        f"enqueued {report.enqueued}, already done {report.already_done}, "
        f"already pending {report.already_pending}", soft_wrap=True)
    if s.expected_samples != s.total:
        console.print(f"{s.expected_samples:,} samples in all (one row per prompt and sample)",
                      soft_wrap=True)
    if report.bad_rows:
        console.print(f"quarantined {plural(len(report.bad_rows), 'bad row')} (stored with their "
                      f"reason), first: {report.bad_rows[0]}", soft_wrap=True)


def _fmt_eta(hours: float | None) -> str:
    if hours is None:
        return "unknown"
    if hours < 1:
        return f"{hours * 60:.1f} min"
    return f"{hours:.2f} h"


def _num(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def status_table(st: dict[str, Any]) -> Group:
    """The status view: a per-worker table (``gpu``: its GPU or GPU group, ``0-1``) and a
    totals table."""
    gpus = Table(title="workers", expand=False)
    for col in ("node", "gpu", "state", "tok/s", "running/cap", "queue", "batches", "restarts",
                "profile"):
        gpus.add_column(col)
    for w in st["workers"]:
        gpus.add_row(w["node"], str(w.get("group", w["gpu"])), w["engine_state"],
                     _num(None if w["tokens_per_sec"] is None else round(w["tokens_per_sec"])),
                     f"{_num(w.get('running'))}/{_num(w.get('cap'))}", _num(w.get("queued")),
                     _num(w["batches_running"]), str(w["engine_restarts"]), w["profile"])
    quality = st.get("quality") or {}
    state = shown_state(st["state"], quality.get("gates_failed")) + _paused_by(st)
    tot = Table(title=f"job {st['job']}: {state}", show_header=False)
    tot.add_column("k")
    tot.add_column("v")
    finished = st["completed"] + st["failed"] + st.get("quarantined", 0)
    done_pct = 100 * finished / max(st["total"], 1)
    for k, v in (
        (f"progress ({_unit(st)})", f"{finished:,}/{st['total']:,} ({done_pct:.1f} %)"),
        *([("prompts done (every sample stored)",
            f"{st['prompts_done']:,}/{st['prompts']:,}")]
          if st.get("prompts") not in (None, st["total"]) else []),
        ("completed / failed / quarantined / truncated",
         f"{st['completed']:,} / {st['failed']:,} / {st.get('quarantined', 0):,} / "
         f"{st['truncated']:,}"),
        ("batches done / running / queued",
         f"{st['done_batches']} / {st['in_flight_batches']} / {st['queued_batches']}"),
        *([("split at the job's end", f"{st['splits']['parts']} part(s), "
            f"{st['splits']['rows']:,} rows to idle GPUs")]
          if (st.get("splits") or {}).get("parts") else []),
        ("requests/s", f"{st['rate_per_sec']:.2f}"),
        ("output tokens/s", f"{st['tokens_per_sec']:,.0f}"),
        ("ETA", "done" if st["done"] else _fmt_eta(st["eta_hours"])),
        ("elapsed", f"{st['elapsed_s']:.0f} s"),
        ("data set", st.get("dataset") or "not built"),
        ("quality", _quality_cell(quality)),
        *[("stalled", note) for note in st.get("stalled") or []],
    ):
        tot.add_row(k, v)
    return Group(gpus, tot)


def verify_table(report: dict[str, Any]) -> Table:
    """The verify report as a small table."""
    table = Table(title=f"verify {report['job']}", show_header=False)
    table.add_column("k")
    table.add_column("v")
    for k in ("expected", "prompts", "samples", "rows", "unique", "duplicates", "missing",
              "misplaced", "failed",
              "quarantined", "truncated"):
        table.add_row(k, f"{report.get(k, 0):,}")
    table.add_row("every prompt once", "yes" if report["ok"] else "NO")
    quality = report.get("quality")
    if quality:
        from workers.dataset.quality_gates import summary

        pct = quality.get("completion_tokens") or {}
        table.add_row("completion tokens",
                      " ".join(f"{k} {v:,}" for k, v in pct.items()) or "-")
        names = ", ".join(g["gate"] for g in quality["failed"])
        table.add_row("quality", summary(quality["failed"]) + (f": {names}" if names else ""))
    table.add_row("verdict", verdict(report))
    return table


def verdict(report: dict[str, Any]) -> str:
    """``verify``'s verdict with its exit code: 1 for rows missing or doubled, 5 for a failed
    quality gate (producer/cli.py)."""
    if not report["ok"]:
        return "FAILED: rows missing, doubled or misplaced (exit 1)"
    failed = (report.get("quality") or {}).get("failed") or []
    if failed:
        return f"FAILED: quality gate {', '.join(g['gate'] for g in failed)} (exit 5)"
    return "ok (exit 0)"


def quality_note(st: dict[str, Any]) -> str | None:
    """The line ``status`` adds on stderr: once a data set is committed, its verdict when a
    gate failed (the live tally's warning is then history); before, the live warning."""
    quality = st.get("quality") or {}
    failed = quality.get("gates_failed")
    if failed is not None:
        if not failed:
            return None
        return (f"quality of the committed data set: {len(failed)} gate(s) failed: "
                f"{', '.join(failed)} (figures: fleet verify --job {st['job']})")
    if warning := quality.get("warning"):
        return (f"quality warning (first {quality['live']['rows']:,} rows, live tally): "
                f"{warning}")
    return None


def quality_lines(report: dict[str, Any]) -> list[str]:
    """One line per failed quality gate of a verify report (empty when all pass)."""
    from workers.dataset.quality_gates import gate_line

    return [f"quality gate failed: {gate_line(g)}"
            for g in (report.get("quality") or {}).get("failed", [])]


def watch(console: Console, fetch: Callable[[], dict[str, Any]], interval_s: float,
          as_json: bool) -> None:
    """Redraw the status (or print one JSON line per tick) until the job is done."""
    if as_json:
        while True:
            st = fetch()
            sys.stdout.write(orjson.dumps(st).decode() + "\n")
            sys.stdout.flush()
            if st["done"]:
                return
            time.sleep(interval_s)
    if not console.is_terminal:
        # Piped: one progress line per tick, then the whole view once, ending with a newline.
        while True:
            st = fetch()
            if st["done"]:
                console.print(status_table(_settled(fetch, st)))
                return
            console.print(progress_line(st), soft_wrap=True)
            time.sleep(interval_s)
    with Live(console=console, auto_refresh=False) as live:
        while True:
            st = fetch()
            if st["done"]:
                live.update(status_table(_settled(fetch, st)), refresh=True)
                return
            live.update(status_table(st), refresh=True)
            time.sleep(interval_s)


def _settled(fetch: Callable[[], dict[str, Any]], st: dict[str, Any],
             wait_s: float = SETTLE_WAIT_S) -> dict[str, Any]:
    """The last view of a done job: wait briefly for every worker's first heartbeat after
    the end, so the table shows the fleet as it is now, not the end's load."""
    deadline = time.monotonic() + wait_s
    while any(w.get("stale") for w in st["workers"]) and time.monotonic() < deadline:
        time.sleep(0.5)
        st = fetch()
    return st


def _quality_cell(quality: dict[str, Any]) -> str:
    """The status view's quality row: the committed data set's verdict, else the live
    warning (or how many rows the live tally holds)."""
    if quality.get("gates_failed") is not None:
        verdict = shown_state("", quality["gates_failed"]).lstrip(", ").removeprefix(
            "quality: ") or "ok (every gate passed)"
        return f"committed data set: {verdict}"
    live = quality.get("live") or {}
    if quality.get("warning"):
        return f"WARNING after {live.get('rows', 0):,} rows: {quality['warning']}"
    return f"no gate broken ({live.get('rows', 0):,} rows measured so far)"


def _paused_by(st: dict[str, Any]) -> str:
    """`` (paused by a worker: quality warning ...; fleet resume goes on)`` or ""."""
    by = st.get("paused_by")
    return f" (by a worker on its {by}; fleet resume --job {st['job']} goes on)" if by else ""


def _unit(st: dict[str, Any]) -> str:
    """What a status's ``total`` counts: samples where a prompt has several, else prompts."""
    return "samples" if st.get("prompts") not in (None, st["total"]) else "prompts"


def progress_line(st: dict[str, Any]) -> str:
    """The job's progress in one line (``status --watch`` on a pipe)."""
    finished = st["completed"] + st["failed"] + st.get("quarantined", 0)
    quality = st.get("quality") or {}
    state = shown_state(st["state"], quality.get("gates_failed")) + _paused_by(st)
    return (f"job {st['job']}: {state}, {finished:,}/{st['total']:,} {_unit(st)}, "
            f"{st['tokens_per_sec']:,.0f} tok/s, ETA {_fmt_eta(st['eta_hours'])}"
            + "".join(f"; stalled: {note}" for note in st.get("stalled") or [])
            + (f"; WARNING: {quality['warning']}" if quality.get("warning") else ""))


def jobs_table(rows: list[dict[str, Any]]) -> Table:
    """The job list as a table."""
    table = Table(title="jobs")
    for col in ("job", "state", "progress", "completed", "failed", "batches", "data set"):
        table.add_column(col)
    for j in rows:
        state = shown_state(j["state"], j.get("quality_failed"), j.get("quality_warning"))
        table.add_row(j["job"], state, f"{100 * j['progress']:.1f} %",
                      f"{j['completed']:,}/{j['total']:,}", f"{j['failed']:,}",
                      f"{j['done_batches']}/{j['n_batches']}", j.get("dataset") or "-")
    return table
