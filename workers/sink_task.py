"""The sink as a Celery task: ``fleet.sink_job`` on queue ``sink``, its state in Redis (for
``sink --wait``), the automatic trigger when a job's last batch is done, and the lease keeper of
a sink-only worker. What a run does to the store is :mod:`workers.dataset.sink`."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
from celery import Task, current_app, shared_task

from config.settings import Settings, load_settings
from workers.celery_app import SINK_QUEUE
from workers.dataset.jobs import JobSpec
from workers.dataset.sink import ShardLimits, aggregate
from workers.dataset.sink_lock import SinkLock
from workers.dataset.store import open_store, store_policy
from workers.delivery import jobstate
from workers.delivery.lease import LeaseKeeper, index_key
from workers.errors import FleetError, StoreError
from workers.events import SINK_TASK

log = logging.getLogger(__name__)

LOCK_WAIT_S = 3600
AUTO_DEDUP_S = 300



def state_key(job: str) -> str:
    """Redis hash with the state of the job's latest sink run (for ``sink --wait``)."""
    return jobstate.Keys(job).sink


def set_state(r: redis.Redis, job: str, state: str, request: str | None,
              **extra: Any) -> None:
    """Record the sink state of a job: queued, running, done or failed."""
    fields = {"state": state, "request": request or "", "at": time.time(),
              **{k: orjson.dumps(v) for k, v in extra.items()}}
    r.hset(state_key(job), mapping=fields)


def _aggregate_and_record(r: redis.Redis, job: str, request: str | None,
                          lock: SinkLock) -> dict[str, Any]:
    settings = load_settings()
    store = open_store(settings.store_url, settings.s3)
    set_state(r, job, "running", request)
    summary = aggregate(store, job, ShardLimits.from_settings(settings), store_policy(settings),
                        lock=lock)
    set_state(r, job, "done", request, summary=summary)
    return summary


@shared_task(name=SINK_TASK, bind=True, max_retries=5)
def sink_job(self: Task, job: str, request: str | None = None) -> dict[str, Any]:
    """Aggregate ``job`` into a new version of its data set and commit it."""
    r = redis.Redis.from_url(load_settings().redis_url.get_secret_value())
    # A redelivered task (same id, its worker died) takes its own lock back.
    lock = SinkLock(r, job, str(self.request.id or request or uuid.uuid4().hex))
    try:
        if not lock.try_acquire():
            # Another run of this job (or requeue-failed) is writing: come back later.
            raise self.retry(countdown=30, max_retries=LOCK_WAIT_S // 30)
        try:
            return _aggregate_and_record(r, job, request, lock)
        except StoreError as exc:  # transient: a few spaced retries
            if self.request.retries < (self.max_retries or 0):
                set_state(r, job, "retrying", request, error=str(exc))
                raise self.retry(exc=exc, countdown=15) from exc
            set_state(r, job, "failed", request, error=str(exc))
            raise
        except Exception as exc:  # JobError, LockLost and anything unexpected: say so, fail
            set_state(r, job, "failed", request, error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            lock.release()
    finally:
        r.close()


def reset_auto_trigger(r: redis.Redis, job: str) -> None:
    """Forget that the sink was triggered automatically, so the next last batch triggers it."""
    r.delete(_auto_key(job))


def start_lease_keeper(app: Any) -> LeaseKeeper:
    """For a sink-only worker (no engine, so no runtime): renew the leases of its tasks."""
    settings = load_settings()
    client = redis.Redis.from_url(settings.redis_url.get_secret_value(),
                                  **settings.redis_client_options())
    keeper = LeaseKeeper(client, index_key(app), settings.lease_renew_s)
    keeper.start()
    return keeper


def _auto_key(job: str) -> str:
    return f"{state_key(job)}:auto"


def trigger_if_complete(r: redis.Redis, app: Any, spec: JobSpec, settings: Settings) -> bool:
    """Enqueue ``fleet.sink_job`` once when every batch of ``spec`` is done (deduplicated)."""
    if not settings.sink_auto or r.scard(jobstate.Keys(spec.name).done) < spec.n_batches:
        return False
    if not r.set(_auto_key(spec.name), 1, nx=True, ex=AUTO_DEDUP_S):
        return False
    set_state(r, spec.name, "queued", None)
    app.send_task(SINK_TASK, args=[spec.name], queue=SINK_QUEUE)
    return True


async def trigger_when_done(r: aioredis.Redis, spec: JobSpec, settings: Settings) -> bool:
    """From a batch task: enqueue ``fleet.sink_job`` once when the job's last batch is done."""
    if not settings.sink_auto or await r.scard(jobstate.Keys(spec.name).done) < spec.n_batches:
        return False
    if not await r.set(_auto_key(spec.name), 1, nx=True, ex=AUTO_DEDUP_S):
        return False
    await r.hset(state_key(spec.name), mapping={"state": "queued", "request": "",
                                                "at": time.time()})
    await asyncio.to_thread(current_app.send_task, SINK_TASK, args=[spec.name],
                            queue=SINK_QUEUE)
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
        raw = {k.decode(): v for k, v in r.hgetall(state_key(job)).items()}
        if raw.get("request", b"").decode() == request:
            state = raw["state"].decode()
            if state == "done":
                return dict(orjson.loads(raw["summary"]))
            if state == "failed":
                raise FleetError(f"sink of {job} failed: {orjson.loads(raw['error'])}")
        time.sleep(poll_s)
    raise FleetError(f"sink of {job} not done after {timeout_s:.0f} s; is a sink worker "
                     "running (celery -A workers worker -Q sink)?")
