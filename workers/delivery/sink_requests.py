"""Asking for a sink run and following it: the run's state in Redis (for ``sink --wait`` and
``status``), the one automatic trigger when a job's last batch is done, and an operator's
explicit request. The run itself is the ``fleet.sink_job`` task (workers/wiring/sink_task.py)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis

from config.settings import Settings
from workers.dataset.jobs import JobSpec
from workers.errors import FleetError
from workers.node.queues import SINK_QUEUE, SINK_TASK
from workers.redisdb import scripts
from workers.redisdb.keys import JobKeys

log = logging.getLogger(__name__)

# A job whose last batch is done triggers its sink once in this window, however many of its
# batches report done (redeliveries, the stored-results shortcut, requeue-failed).
AUTO_DEDUP_S = 300

def set_state(r: redis.Redis, job: str, state: str, request: str | None,
              **extra: Any) -> None:
    """Record the sink state of a job: queued, running, retrying, done or failed."""
    fields = {"state": state, "request": request or "", "at": time.time(),
              **{k: orjson.dumps(v) for k, v in extra.items()}}
    r.hset(JobKeys(job).sink, mapping=fields)


def reset_auto_trigger(r: redis.Redis, job: str) -> None:
    """Forget that the sink was triggered automatically, so the next last batch triggers it."""
    r.delete(JobKeys(job).sink_auto)


def trigger_if_complete(r: redis.Redis, app: Any, spec: JobSpec, settings: Settings) -> bool:
    """Enqueue ``fleet.sink_job`` once when every batch of ``spec`` is done (deduplicated)."""
    if not settings.sink_auto or not scripts.claim_sink_trigger(r, spec.name, spec.n_batches,
                                                                AUTO_DEDUP_S):
        return False
    app.send_task(SINK_TASK, args=[spec.name], queue=SINK_QUEUE)
    return True


async def trigger_when_done(r: aioredis.Redis, app: Any, spec: JobSpec,
                            settings: Settings) -> bool:
    """:func:`trigger_if_complete` from a batch task, on its async Redis client."""
    if not settings.sink_auto or not await scripts.claim_sink_trigger(
            r, spec.name, spec.n_batches, AUTO_DEDUP_S):
        return False
    await asyncio.to_thread(app.send_task, SINK_TASK, args=[spec.name], queue=SINK_QUEUE)
    log.info("job %s: last batch done, sink enqueued", spec.name)
    return True


def request_sink(r: redis.Redis, app: Any, job: str) -> str:
    """Enqueue a sink run of ``job`` for the sink worker; return its request id."""
    request = uuid.uuid4().hex
    set_state(r, job, "queued", request)
    app.send_task(SINK_TASK, args=[job, request], queue=SINK_QUEUE)
    return request


def wait_sink(r: redis.Redis, job: str, request: str, timeout_s: float,
              poll_s: float = 0.5) -> dict[str, Any]:
    """Wait until the sink run ``request`` is done; return its summary (FleetError if not)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = {k.decode(): v for k, v in r.hgetall(JobKeys(job).sink).items()}
        if raw.get("request", b"").decode() == request:
            state = raw["state"].decode()
            if state == "done":
                return dict(orjson.loads(raw["summary"]))
            if state == "failed":
                raise FleetError(f"sink of {job} failed: {orjson.loads(raw['error'])}")
        time.sleep(poll_s)
    raise FleetError(f"sink of {job} not done after {timeout_s:.0f} s; is a GPU worker "
                     "running? (each one also consumes the sink queue; see README)")
