"""The batch task: thin Celery glue around :class:`workers.batch_runner.BatchRunner`."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
from celery import Task, shared_task
from celery.exceptions import Reject

from config.settings import Settings, load_settings
from workers import jobstate, metrics
from workers.batch_runner import (
    BatchRunner,
    EngineDown,
    JobStopped,
)
from workers.context import identity
from workers.errors import JobError
from workers.events import TaskProgress
from workers.heartbeat import heartbeat_key
from workers.jobs import load_checked_input, load_spec, result_key
from workers.progress import BatchEnv
from workers.store import RetryingStore, Store, open_store, store_policy

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _settings_and_store() -> tuple[Settings, Store]:
    settings = load_settings()
    # Every store call of a batch retries a failing store (an outage) with the fleet's policy.
    return settings, RetryingStore(open_store(settings.store_url, settings.s3),
                                   store_policy(settings))


def _engine_profile(beat: bytes | None, default: str) -> tuple[str, int | None, str | None]:
    """The running engine's profile name, fixed client concurrency and launch digest, from
    its heartbeat."""
    data = orjson.loads(beat) if beat else {}
    return str(data.get("profile", default)), data.get("client_concurrency"), data.get(
        "launch_digest")


async def _run(task: Task, job: str, batch: int) -> dict[str, Any]:
    settings, store = _settings_and_store()
    me = identity()
    r = aioredis.from_url(settings.redis_url.get_secret_value())
    keys = jobstate.Keys(job)
    try:
        if await r.sismember(keys.done, batch):
            return {"job": job, "batch": batch, "skipped": "already done"}
        state = (await r.hget(keys.job, "state") or b"running").decode()
        if state != "running":
            # Paused or cancelled after this message was queued: drop it; resume re-sends it.
            await r.srem(keys.pending, batch)
            return {"job": job, "batch": batch, "skipped": f"job {state}"}
        spec = await asyncio.to_thread(load_spec, store, job)
        if await asyncio.to_thread(store.exists, result_key(job, batch)):
            # Results are durable but Redis lost the "done" mark (a restart): just record it.
            await r.sadd(keys.done, batch)
            await r.srem(keys.pending, batch)
            return {"job": job, "batch": batch, "skipped": "results already stored"}
        rows = await asyncio.to_thread(load_checked_input, store, spec, batch)
        beat = await r.get(heartbeat_key(me.node))
        profile, fixed, digest = _engine_profile(beat, settings.profile)
        progress = TaskProgress(task.app, task.request.id, task.request.hostname, len(rows),
                                me.gpu, settings.progress_event_interval_s)
        env = BatchEnv(settings=settings, me=me, store=store, redis=r, profile=profile,
                       profile_concurrency=fixed, on_progress=progress, launch_digest=digest)
        summary = await BatchRunner(env, spec, batch, rows).run()
        await metrics.record_batch(r, me.node, summary["seconds"])
        return summary
    finally:
        await r.aclose()


def _forget_batch(job: str, batch: int) -> None:
    """The batch is neither pending nor running any more (``enqueue`` may resend it)."""
    settings, _ = _settings_and_store()
    keys = jobstate.Keys(job)
    client = redis.Redis.from_url(settings.redis_url.get_secret_value())
    try:
        client.srem(keys.pending, batch)
        client.hdel(keys.running, batch)
    finally:
        client.close()


class BatchTask(Task):
    """Keeps Redis's view of the job right when a batch fails for good."""

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any,
                   einfo: Any) -> None:
        """A failed batch is no longer pending, so ``enqueue`` (reconcile) will resend it."""
        log.error("batch %s/%s failed for good: %s; re-run enqueue to resend it",
                  args[0], args[1], exc)
        _forget_batch(args[0], args[1])


@shared_task(name="fleet.run_batch", bind=True, base=BatchTask, max_retries=3)
def run_batch(self: Task, job: str, batch: int) -> dict[str, Any]:
    """Generate every prompt of ``batch`` of ``job`` and store the results."""
    try:
        return asyncio.run(_run(self, job, batch))
    except EngineDown as exc:
        # Another GPU can take it: back of the queue, not a failure.
        raise Reject(str(exc), requeue=True) from exc
    except JobStopped as exc:
        _forget_batch(job, batch)
        return {"job": job, "batch": batch, "skipped": str(exc)}
    except JobError:
        raise
    except Exception as exc:  # anything else: a few spaced retries, then on_failure
        raise self.retry(exc=exc, countdown=10) from exc
