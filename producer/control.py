"""Job control: pause, resume, cancel and list jobs.

A job's state lives in its Redis hash (``fleet:job:{j}`` field ``state``): ``running``,
``paused`` or ``cancelled``. Pausing or cancelling removes the job's queued batches from the
queues; a batch that slips through (a lease that lapses later) is dropped by the task when it
sees the state. Paused: running batches finish; ``resume`` re-enqueues what is neither done nor
pending (the same reconcile as ``enqueue``). Cancelled: running batches stop within about a
second; what was already stored stays in the store.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson
import redis
from celery import Celery

from producer.enqueue import EnqueueReport, reconcile
from workers import jobstate
from workers.celery_app import SHARED_QUEUE
from workers.errors import JobError
from workers.jobs import JobSpec
from workers.store import Store

STATES = ("running", "paused", "cancelled")


def _message_job(raw: bytes) -> str | None:
    """Job name of a queued kombu message carrying fleet.run_batch, else None."""
    try:
        msg = orjson.loads(raw)
        if msg.get("headers", {}).get("task") != "fleet.run_batch":
            return None
        args = orjson.loads(base64.b64decode(msg["body"]))[0]
        return str(args[0])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError):
        return None


def _queue_lists(r: redis.Redis) -> list[bytes]:
    """The Redis lists that hold batch messages (shared and pinned queues, all priorities)."""
    names: set[bytes] = set()
    for pattern in (SHARED_QUEUE, f"{SHARED_QUEUE}[0-9]*"):
        names.update(r.scan_iter(match=f"{pattern}*", _type="LIST"))
    return sorted(names)


def remove_queued(r: redis.Redis, job: str) -> int:
    """Remove every queued (not yet delivered) batch message of ``job``; return how many."""
    removed = 0
    for name in _queue_lists(r):
        for raw in r.lrange(name, 0, -1):
            if _message_job(raw) == job:
                removed += int(r.lrem(name, 1, raw))
    return removed


def set_state(r: redis.Redis, job: str, state: str) -> None:
    """Record the job's state (checked by every batch at start and while it runs)."""
    if not r.sismember(jobstate.JOBS_KEY, job):
        raise JobError(f"no job {job!r} in Redis (run enqueue first)")
    r.hset(jobstate.Keys(job).job, "state", state)


def stop_job(r: redis.Redis, job: str, state: str) -> int:
    """Pause or cancel: set the state, pull queued batches, forget them as pending."""
    set_state(r, job, state)
    removed = remove_queued(r, job)
    keys = jobstate.Keys(job)
    running = {int(b) for b in r.hkeys(keys.running)}
    queued = [int(b) for b in r.smembers(keys.pending) if int(b) not in running]
    if queued:
        r.srem(keys.pending, *queued)
    return removed


def resume_job(store: Store, r: redis.Redis, app: Celery, spec: JobSpec) -> EnqueueReport:
    """Mark the job running again and enqueue what is neither done nor pending."""
    set_state(r, spec.name, "running")
    report = EnqueueReport(spec=spec, created=False)
    reconcile(store, r, app, spec, report)
    return report


def list_jobs(r: redis.Redis) -> list[dict[str, Any]]:
    """Every job Redis knows, with its state and progress."""
    out = []
    for name in sorted(n.decode() for n in r.smembers(jobstate.JOBS_KEY)):
        keys = jobstate.Keys(name)
        spec_raw, state = r.hmget(keys.job, ["spec", "state"])
        spec = JobSpec.model_validate_json(spec_raw) if spec_raw else None
        c = jobstate.counters(r, name)
        total = spec.total if spec else 0
        out.append({"job": name, "state": (state or b"running").decode(), "total": total,
                    "completed": c["completed"], "failed": c["failed"],
                    "done_batches": r.scard(keys.done),
                    "n_batches": spec.n_batches if spec else 0,
                    "progress": round((c["completed"] + c["failed"]) / total, 4) if total else 0})
    return out
