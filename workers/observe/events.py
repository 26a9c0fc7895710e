"""What Flower shows of the fleet: batch progress events, the task formatter, worker info.

Flower (2.2) only knows Celery's events (its ``EventReceiver`` on the ``celeryev``
exchange) and ``inspect`` replies (``stats``, ``active``, ...), so:

- a running batch sends ``task-progress`` events; Flower merges their fields into the task and
  lists it as PROGRESS. The numbers (prompts done, output tokens, tokens/s) travel as the
  ``result`` field, a dict repr like the one Celery sends on success: Flower copies a task
  with its standard fields only before formatting it, so other fields would never be shown.
  The events are sent before the batch returns, so none can overwrite the final result;
- :func:`format_task` (Flower's ``format_task`` option, set in ``deploy/flowerconfig.py``)
  turns either dict into one line in the Result column: prompts, output tokens, tokens/s;
- :func:`worker_info` is what the engine bootstep adds to ``inspect stats``: Flower shows it
  on each worker's page (tab "Other": GPU, profile, engine state, running/cap, queue, tokens/s).

Events are best effort: Redis PUB/SUB keeps nothing, and a lost event only delays the display.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import math
import time
from typing import Any

from celery import Celery
from kombu.exceptions import KombuError, OperationalError

from workers.node.queues import BATCH_TASK, SINK_TASK

log = logging.getLogger(__name__)

PROGRESS_EVENT = "task-progress"


class TaskProgress:
    """Counts one delivery's finished rows and sends them as ``task-progress`` events."""

    def __init__(self, app: Celery, task_id: str, hostname: str, total: int, gpu: int,
                 interval_s: float) -> None:
        self.app, self.task_id, self.hostname = app, task_id, hostname
        self.total, self.gpu, self.interval_s = total, gpu, interval_s
        self.done = self.tokens = 0
        self._t0 = time.monotonic()
        self._sent_at = -math.inf

    def __repr__(self) -> str:
        return f"<TaskProgress {self.task_id} {self.done}/{self.total} tokens={self.tokens}>"

    async def __call__(self, rows: int, tokens: int) -> None:
        """Add rows just recorded; send an event if the last one is ``interval_s`` old."""
        self.done += rows
        self.tokens += tokens
        if time.monotonic() - self._sent_at >= self.interval_s:
            await self.send()

    def fields(self) -> dict[str, Any]:
        """The event's fields (this delivery's rows; a redelivery starts from zero)."""
        elapsed = max(time.monotonic() - self._t0, 1e-3)
        return {"prompts_done": self.done, "prompts_total": self.total,
                "output_tokens": self.tokens, "tokens_per_sec": round(self.tokens / elapsed, 1),
                "elapsed_s": round(elapsed, 1), "gpu": self.gpu}

    async def send(self) -> None:
        """Publish one event now, off the event loop (a slow broker must not stall requests)."""
        self._sent_at = time.monotonic()
        await asyncio.to_thread(self._publish, self.fields())

    def _publish(self, fields: dict[str, Any]) -> None:
        try:
            with self.app.events.default_dispatcher(hostname=self.hostname) as dispatcher:
                dispatcher.send(PROGRESS_EVENT, uuid=self.task_id, retry=False,
                                result=repr(fields))
        except (OSError, OperationalError, KombuError) as exc:
            log.debug("progress event of task %s not sent: %s", self.task_id, exc)


def _as_dict(result: Any) -> dict[str, Any] | None:
    """The dict behind a result repr Flower keeps (``{'rows': 50, ...}``), if it is one."""
    try:
        value = ast.literal_eval(result) if isinstance(result, str) else result
    except (ValueError, SyntaxError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def describe(summary: dict[str, Any]) -> str | None:
    """One line for a batch's progress or its final summary (None for anything else)."""
    if "prompts_done" in summary:
        return (f"{summary['prompts_done']}/{summary['prompts_total']} prompts, "
                f"{summary['output_tokens']:,} tokens, {summary['tokens_per_sec']:,.0f} tok/s")
    if "skipped" in summary:
        return f"skipped: {summary['skipped']}"
    if "rows" not in summary or "output_tokens" not in summary:
        return None
    secs = float(summary.get("seconds") or 0)
    rate = summary["output_tokens"] / secs if secs > 0 else 0.0
    failed = f", {summary['failed']} failed" if summary.get("failed") else ""
    return (f"{summary['rows']} prompts, {summary['output_tokens']:,} tokens, "
            f"{rate:,.0f} tok/s, {secs:.1f} s{failed}")


def describe_sink(summary: dict[str, Any]) -> str | None:
    """One line for a sink run's summary (workers/dataset/sink.py ``aggregate``)."""
    if "version" not in summary or "rows" not in summary:
        return None
    state = "complete" if summary.get("complete") else "incomplete"
    return (f"data set {summary['version']}: {summary['rows']:,} rows in "
            f"{summary.get('shards', '?')} shards, {state}")


def format_task(task: Any) -> Any:
    """Flower ``format_task``: prompts, output tokens and tokens/s of a batch, or the data-set
    version a sink run committed, in the Result column."""
    name = getattr(task, "name", None)
    if name not in (BATCH_TASK, SINK_TASK):
        return task
    summary = _as_dict(task.result)
    text = (describe if name == BATCH_TASK else describe_sink)(summary) if summary else None
    if text is not None:
        task.result = text
    return task


def _count(value: Any) -> str:
    return "?" if value is None else f"{value:,}"


def worker_info(beat: dict[str, Any]) -> dict[str, Any]:
    """``fleet_*`` entries for ``inspect stats`` (Flower's worker page), from the heartbeat."""
    usage = beat.get("kv_usage")
    return {
        "fleet_gpu": beat.get("group", beat["gpu"]),  # "0-1" for a GPU group
        "fleet_engine": beat["engine"],
        "fleet_profile": beat["profile"],
        "fleet_engine_state": beat["engine_state"],
        "fleet_engine_restarts": beat["engine_restarts"],
        "fleet_running_cap": f"{_count(beat.get('running'))}/{_count(beat.get('cap'))}",
        "fleet_queued": _count(beat.get("queued")),
        "fleet_kv_usage": "?" if usage is None else f"{usage:.2f}",
        "fleet_batches_running": beat["batches_running"],
        "fleet_tokens_per_sec": beat["tokens_per_sec"],
        "fleet_output_tokens": beat["output_tokens"],
    }
