"""Job control: pause, resume and cancel jobs.

A job's state lives in its Redis hash (``fleet:job:{j}`` field ``state``): ``running``,
``paused`` or ``cancelled``; ``done`` is derived (workers/delivery/job_progress.py). Pausing
or cancelling removes the job's queued batches from the queues; a batch that slips through (a
lease that lapses later) is dropped by the task when it sees the state. Paused: running
batches finish; ``resume`` re-enqueues every batch that is not stored and has no message and
no live run (the same reconcile as ``enqueue``). Cancelled: running batches stop within about
a second; what was already stored stays in the store.
"""

from __future__ import annotations

import redis
from celery import Celery

from producer.enqueue import EnqueueReport, reconcile
from workers.dataset.jobs import JobSpec
from workers.dataset.store import Store
from workers.delivery.whereabouts import remove_queued
from workers.errors import JobError
from workers.redisdb.keys import JOBS_KEY, JobKeys

STATES = ("running", "paused", "cancelled")


def set_state(r: redis.Redis, job: str, state: str) -> None:
    """Record the job's state (checked by every batch at start and while it runs)."""
    if not r.sismember(JOBS_KEY, job):
        raise JobError(f"no job {job!r} in Redis (run enqueue first)")
    pipe = r.pipeline()
    pipe.hset(JobKeys(job).job, "state", state)
    pipe.hdel(JobKeys(job).job, "paused_by")  # set only by a worker's quality pause
    pipe.execute()


def stop_job(r: redis.Redis, job: str, state: str) -> int:
    """Pause or cancel: set the state and pull the job's queued batches. Nothing else is
    remembered: ``resume`` derives what to resend (workers/delivery/whereabouts.py)."""
    set_state(r, job, state)
    return remove_queued(r, job)


def resume_job(store: Store, r: redis.Redis, app: Celery, spec: JobSpec) -> EnqueueReport:
    """Mark the job running again and enqueue what is not stored, queued or held."""
    set_state(r, spec.name, "running")
    report = EnqueueReport(spec=spec, created=False)
    reconcile(store, r, app, spec, report)
    return report
