"""The batch task: thin Celery glue around :class:`workers.batch_runner.BatchRunner`.

A delivery claims the batch (workers/delivery/ownership.py) before it sends anything, and the
store decides whether the batch is done: a done mark in Redis whose result object is gone is
dropped and the batch generated again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
from billiard.exceptions import WorkerLostError
from celery import Task, shared_task
from celery.exceptions import Reject
from celery.worker.request import Request

from config.settings import Settings, load_settings
from workers import metrics, sink_task
from workers.batch_runner import BatchRunner, HandBack, JobStopped
from workers.context import identity
from workers.dataset.jobs import load_checked_input, load_spec, result_key
from workers.dataset.store import RetryingStore, Store, open_store, store_policy
from workers.delivery import jobstate, whereabouts
from workers.delivery.ownership import ClaimLapsed, LostOwnership, Ownership
from workers.delivery.progress import BatchEnv, drop_progress
from workers.errors import JobError
from workers.events import TaskProgress
from workers.heartbeat import heartbeat_key

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


def _settle_stored(settings: Settings, store: Store, job: str, batch: int) -> None:
    """The result is stored but Redis may not know (a restart, a crash before the finish
    step): count it as the store says, mark it done, drop its leftover progress."""
    r = redis.Redis.from_url(settings.redis_url.get_secret_value(),
                             **settings.redis_client_options())
    try:
        whereabouts.count_stored(store, r, job, batch)
        keys = jobstate.Keys(job)
        unowned = r.eval("if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end "
                         "redis.call('DEL', KEYS[2]) return 1",
                         2, keys.owner(batch), keys.progress(batch))
    finally:
        r.close()
    if unowned:  # a live run's chunks are its own to drop
        drop_progress(store, job, batch)


def _skipped(job: str, batch: int, why: str) -> dict[str, Any]:
    return {"job": job, "batch": batch, "skipped": why}


async def _run(task: Task, job: str, batch: int) -> dict[str, Any]:
    settings, store = _settings_and_store()
    me = identity()
    r = aioredis.from_url(settings.redis_url.get_secret_value(),
                          **settings.redis_client_options())
    try:
        state = (await r.hget(jobstate.Keys(job).job, "state") or b"running").decode()
        if state != "running":
            # Paused or cancelled after this message was queued: drop it; resume re-sends it.
            return _skipped(job, batch, f"job {state}")
        spec = await asyncio.to_thread(load_spec, store, job)

        async def stored() -> bool:
            return await asyncio.to_thread(store.exists, result_key(job, batch))

        if await stored():
            await asyncio.to_thread(_settle_stored, settings, store, job, batch)
            await sink_task.trigger_when_done(r, spec, settings)
            return _skipped(job, batch, "results already stored")
        owner = Ownership(r, job, batch, me.node, settings.visibility_timeout_s)
        wait_s = settings.visibility_timeout_s + settings.lease_renew_s
        claimed = await owner.acquire(stored, wait_s)
        if claimed.status == "done":
            return _skipped(job, batch, "already done")
        if claimed.status == "held":
            # A live run owns it (a duplicate message, or a run that is still letting go):
            # keep a message for the batch rather than ack the only one away.
            raise HandBack(f"batch {job}/{batch} is held by {claimed.holder}")
        owner.start_keeping(settings.lease_renew_s)
        # The start of the job's active span (workers/delivery/job_progress.py).
        await r.hsetnx(jobstate.Keys(job).job, "first_taken_at", round(time.time(), 3))
        try:
            return await _generate(task, settings, store, r, spec, batch, owner)
        finally:
            await owner.stop_keeping()
            try:
                await owner.release()  # a no-op once finished or taken over
            except (redis.RedisError, OSError):
                pass  # the claim then lapses by itself
    finally:
        await r.aclose()


async def _generate(task: Task, settings: Settings, store: Store, r: aioredis.Redis,
                    spec: Any, batch: int, owner: Ownership) -> dict[str, Any]:
    me = identity()
    rows = await asyncio.to_thread(load_checked_input, store, spec, batch)
    beat = await r.get(heartbeat_key(me.node))
    profile, fixed, digest = _engine_profile(beat, settings.profile)
    progress = TaskProgress(task.app, task.request.id, task.request.hostname, len(rows),
                            me.gpu, settings.progress_event_interval_s)
    env = BatchEnv(settings=settings, me=me, store=store, redis=r, profile=profile,
                   profile_concurrency=fixed, on_progress=progress, launch_digest=digest)
    summary = await BatchRunner(env, spec, batch, rows, owner).run()
    await metrics.record_batch(r, me.node, summary["seconds"])
    return summary


def count_child_death(args: Any) -> None:
    """One more pool process died while running this batch (from the worker's main process)."""
    from workers.signals import current_runtime

    runtime = current_runtime()
    try:
        job, batch = str(args[0]), int(args[1])
    except (TypeError, IndexError, ValueError):
        return
    if runtime is None:
        return
    try:
        runtime.redis.hincrby(jobstate.Keys(job).child_deaths, batch, 1)
    except redis.RedisError as exc:
        log.warning("could not count the lost pool process of %s/%s: %s", job, batch, exc)


class BatchRequest(Request):
    """The worker's view of one delivery: counts pool processes that die running a batch, so a
    batch that kills its process every time is quarantined instead of requeued forever."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> None:
        """Count a lost pool process, then let Celery requeue the batch as usual."""
        exc = getattr(exc_info.exception, "exc", exc_info.exception)
        if isinstance(exc, WorkerLostError):
            count_child_death(self.args)
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


class BatchTask(Task):
    """Logs a batch that failed for good; reconcile (``enqueue``, ``resume``) resends it."""

    Request = BatchRequest

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any,
                   einfo: Any) -> None:
        """Nothing to undo in Redis: where the batch is gets derived when it matters."""
        log.error("batch %s/%s failed for good: %s; re-run enqueue to resend it",
                  args[0], args[1], exc)


@shared_task(name="fleet.run_batch", bind=True, base=BatchTask, max_retries=3)
def run_batch(self: Task, job: str, batch: int) -> dict[str, Any]:
    """Generate every prompt of ``batch`` of ``job`` and store the results."""
    try:
        return asyncio.run(_run(self, job, batch))
    except (HandBack, ClaimLapsed) as exc:
        # Another GPU (or this one, later) takes it, with its answered prompts kept.
        log.warning("batch %s/%s handed back: %s", job, batch, exc)
        raise Reject(str(exc), requeue=True) from exc
    except (JobStopped, LostOwnership) as exc:
        return _skipped(job, batch, str(exc))
    except JobError:
        raise
    except Exception as exc:  # anything else: a few spaced retries, then on_failure
        raise self.retry(exc=exc, countdown=10) from exc
