"""The sink as a Celery task: ``fleet.sink_job`` on queue ``sink``, and the lease keeper of a
sink-only worker. How a run is asked for and followed is :mod:`workers.delivery.sink_requests`;
what a run does to the store is :mod:`workers.dataset.sink`."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import redis
from celery import Task, shared_task

from config.settings import load_settings
from workers.dataset.location import job_store_url
from workers.dataset.sink import ShardLimits, aggregate
from workers.dataset.sink_lock import SinkLock
from workers.dataset.store import open_store, store_policy
from workers.delivery.lease import LeaseKeeper, index_key
from workers.delivery.sink_requests import set_state
from workers.errors import StoreError
from workers.node.queues import SINK_TASK

log = logging.getLogger(__name__)

LOCK_WAIT_S = 3600



# Spaced retries of a sink run whose store fails (an outage): the task's and ``sink --local``'s.
SINK_RETRIES, SINK_RETRY_S = 5, 15


def _aggregate_and_record(r: redis.Redis, job: str, request: str | None,
                          lock: SinkLock) -> dict[str, Any]:
    settings = load_settings()
    # The job's own store (workers/dataset/location.py), wherever this process was started.
    url = job_store_url(r, job, settings.store_url, explicit=False)
    store = open_store(url, settings.s3)
    set_state(r, job, "running", request)
    summary = aggregate(store, job, ShardLimits.from_settings(settings), store_policy(settings),
                        lock=lock)
    set_state(r, job, "done", request, summary=summary)
    return summary


def sink_run(r: redis.Redis, job: str, request: str | None, lock: SinkLock,
             retries_left: int) -> dict[str, Any]:
    """One sink run of ``job`` under the held ``lock``, its state recorded (``sink --wait``
    and ``status`` read it). A failing store raises StoreError with the state ``retrying``
    while ``retries_left``, else ``failed``; any other error records ``failed``."""
    try:
        return _aggregate_and_record(r, job, request, lock)
    except StoreError as exc:  # transient: the caller retries after SINK_RETRY_S
        if retries_left > 0:
            set_state(r, job, "retrying", request, error=str(exc))
        else:
            set_state(r, job, "failed", request, error=str(exc))
        raise
    except Exception as exc:  # JobError, LockLost and anything unexpected: say so, fail
        set_state(r, job, "failed", request, error=f"{type(exc).__name__}: {exc}")
        raise


def sink_here(r: redis.Redis, job: str, lock: SinkLock, request: str) -> dict[str, Any]:
    """``sink --local``: the task's run in this process, with the task's state and retries."""
    for attempt in range(SINK_RETRIES + 1):
        try:
            return sink_run(r, job, request, lock, SINK_RETRIES - attempt)
        except StoreError:
            if attempt == SINK_RETRIES:
                raise
            time.sleep(SINK_RETRY_S)
    raise AssertionError("unreachable")


@shared_task(name=SINK_TASK, bind=True, max_retries=SINK_RETRIES)
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
            left = (self.max_retries or 0) - self.request.retries
            return sink_run(r, job, request, lock, left)
        except StoreError as exc:
            if self.request.retries < (self.max_retries or 0):
                raise self.retry(exc=exc, countdown=SINK_RETRY_S) from exc
            raise
        finally:
            lock.release()
    finally:
        r.close()


def start_lease_keeper(app: Any) -> LeaseKeeper:
    """For a sink-only worker (no engine, so no runtime): renew the leases of its tasks."""
    settings = load_settings()
    client = redis.Redis.from_url(settings.redis_url.get_secret_value(),
                                  **settings.redis_client_options())
    keeper = LeaseKeeper(client, index_key(app), settings.lease_renew_s)
    keeper.start()
    return keeper
