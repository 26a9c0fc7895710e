"""The batch task: thin Celery glue around :class:`workers.batch.runner.BatchRunner`.

A delivery claims the batch (workers/delivery/ownership.py) before it sends anything, and the
store decides whether the batch is done: a done mark in Redis whose result object is gone is
dropped and the batch generated again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, NoReturn

import orjson
import redis
import redis.asyncio as aioredis
from billiard.exceptions import WorkerLostError
from celery import Task, current_app, shared_task
from celery.exceptions import Reject
from celery.worker.request import Request

from config.launch_profile import unmet_needs
from config.settings import Settings, load_settings
from workers.batch.runner import BatchRunner
from workers.batch.units import HandBack, JobStopped
from workers.dataset.jobs import load_checked_input, load_spec, result_key
from workers.dataset.location import choose_store
from workers.dataset.store import RetryingStore, Store, open_store, store_policy
from workers.delivery import jobstate, sink_requests, whereabouts
from workers.delivery.ownership import ClaimLapsed, LostOwnership, Ownership
from workers.delivery.progress import BatchEnv, drop_progress
from workers.errors import JobError
from workers.node.context import identity
from workers.node.queues import BATCH_TASK, TAKE_TASK
from workers.observe import metrics
from workers.observe.events import TaskProgress
from workers.redisdb import scripts
from workers.redisdb.keys import JobKeys, NodeKeys
from workers.split import asker
from workers.split.protocol import Part

log = logging.getLogger(__name__)


# Seconds a worker that cannot read a job's store, or runs another profile than the job
# needs, waits before it hands the batch back.
UNREADABLE_PAUSE_S = 5.0


@functools.lru_cache(maxsize=1)
def _settings() -> Settings:
    return load_settings()


@functools.lru_cache(maxsize=16)
def _store(url: str) -> Store:
    settings = _settings()
    # Every store call of a batch retries a failing store (an outage) with the fleet's policy.
    return RetryingStore(open_store(url, settings.s3), store_policy(settings))


async def _open_job(r: aioredis.Redis, settings: Settings, job: str, batch: int
                    ) -> tuple[Store, Any]:
    """The store the job was enqueued into (workers/dataset/location.py, not this worker's
    own FLEET_STORE_URL: a worker started in another folder has another default store) and
    the job's spec, once this worker can run it (else :func:`_stall`)."""
    raw = await r.hget(JobKeys(job).job, "store_url")
    store = _store(choose_store(job, raw.decode() if raw else None, settings.store_url,
                                explicit=False))
    spec = await _load_spec_or_stall(r, store, job, batch)
    await _check_profile(r, job, batch)
    return store, spec


async def _stall(r: aioredis.Redis, job: str, batch: int, why: str, cause: str = "") -> NoReturn:
    """Say in ``status`` (``stalled:``) why this worker cannot run the job, then hand the batch
    back rather than fail it for good: a worker that can run it takes it, or this one later."""
    node = identity().node
    await jobstate.note_stalled(r, job, node, why)
    log.warning("batch %s/%s: %s%s; handing it back", job, batch, why, cause and f" ({cause})")
    await asyncio.sleep(UNREADABLE_PAUSE_S)
    raise HandBack(f"{node} {why}")


async def _load_spec_or_stall(r: aioredis.Redis, store: Store, job: str, batch: int) -> Any:
    """The job's spec, or :func:`_stall` where this worker cannot read it."""
    try:
        spec = await asyncio.to_thread(load_spec, store, job)
    except JobError as exc:
        await _stall(r, job, batch, f"cannot read job {job} in {store.url}", str(exc))
    await jobstate.clear_stalled(r, job, identity().node)
    return spec


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
        unowned = scripts.drop_unowned_progress(r, job, batch)
    finally:
        r.close()
    if unowned:  # a live run's chunks are its own to drop
        drop_progress(store, job, batch)


async def _check_profile(r: aioredis.Redis, job: str, batch: int) -> None:
    """Hand the batch back (and say so in ``status``) when this worker's engine runs without
    an output flag the job needs (a tool-call parser of the profile it was enqueued for)."""
    node = identity().node
    need_profile, raw_needs = await r.hmget(JobKeys(job).job, ["profile", "needs"])
    beat = orjson.loads(await r.get(NodeKeys(node).heartbeat) or b"{}")
    if not raw_needs or "output_flags" not in beat:
        return
    missing = unmet_needs(orjson.loads(raw_needs), beat["output_flags"])
    if not missing:
        return
    why = (f"runs profile {beat.get('profile')}, job {job} needs {', '.join(missing)} "
           f"(profile {need_profile.decode() if need_profile else '?'})")
    await _stall(r, job, batch, why)


def _skipped(job: str, batch: int, why: str) -> dict[str, Any]:
    return {"job": job, "batch": batch, "skipped": why}


async def _run(task: Task, job: str, batch: int) -> dict[str, Any]:
    settings = _settings()
    me = identity()
    r = aioredis.from_url(settings.redis_url.get_secret_value(),
                          **settings.redis_client_options())
    try:
        state = (await r.hget(JobKeys(job).job, "state") or b"running").decode()
        if state != "running":
            # Paused or cancelled after this message was queued: drop it; resume re-sends it.
            return _skipped(job, batch, f"job {state}")
        store, spec = await _open_job(r, settings, job, batch)

        async def stored() -> bool:
            return await asyncio.to_thread(store.exists, result_key(job, batch))

        if await stored():
            await asyncio.to_thread(_settle_stored, settings, store, job, batch)
            await sink_requests.trigger_when_done(r, current_app, spec, settings)
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
        async with owner.kept(settings.lease_renew_s):
            # The start of the job's active span (workers/delivery/job_progress.py).
            await r.hsetnx(JobKeys(job).job, "first_taken_at", round(time.time(), 3))
            return await _generate(task, settings, store, r, spec, batch, owner)
    finally:
        await r.aclose()


async def _generate(task: Task, settings: Settings, store: Store, r: aioredis.Redis,
                    spec: Any, batch: int, owner: Ownership,
                    part: Part | None = None) -> dict[str, Any]:
    me = identity()
    rows = await asyncio.to_thread(load_checked_input, store, spec, batch)
    beat = await r.get(NodeKeys(me.node).heartbeat)
    profile, fixed, digest = _engine_profile(beat, settings.profile)
    progress = TaskProgress(task.app, task.request.id, task.request.hostname,
                            len(part.rows) if part else len(rows), me.gpu,
                            settings.progress_event_interval_s)
    env = BatchEnv(settings=settings, me=me, store=store, redis=r, profile=profile,
                   profile_concurrency=fixed, on_progress=progress, launch_digest=digest)
    summary = await BatchRunner(env, spec, batch, rows, owner, part).run()
    if part is None:
        await metrics.record_batch(r, me.node, summary["seconds"])
    return summary


async def _take(task: Task, job: str, batch: int) -> dict[str, Any]:
    """Ask batch ``batch``'s owner for its unsent rows; generate those granted as a part."""
    settings = _settings()
    me = identity()
    r = aioredis.from_url(settings.redis_url.get_secret_value(),
                          **settings.redis_client_options())
    try:
        if (await r.hget(JobKeys(job).job, "state") or b"running") != b"running":
            return _skipped(job, batch, "job not running")
        store, spec = await _open_job(r, settings, job, batch)
        got = await asker.ask(r, job, batch, me.node, settings.visibility_timeout_s)
        if isinstance(got, str):
            return _skipped(job, batch, got)
        part, claim = got
        # Released at the end: the batch's owner sends what the part did not answer.
        async with claim.kept(settings.lease_renew_s):
            return await _generate(task, settings, store, r, spec, batch, claim, part)
    finally:
        await r.aclose()


def count_child_death(args: Any) -> None:
    """One more pool process died while running this batch (from the worker's main process)."""
    from workers.wiring.signals import current_runtime

    runtime = current_runtime()
    try:
        job, batch = str(args[0]), int(args[1])
    except (TypeError, IndexError, ValueError):
        return
    if runtime is None:
        return
    try:
        runtime.redis.hincrby(JobKeys(job).child_deaths, batch, 1)
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


@shared_task(name=BATCH_TASK, bind=True, base=BatchTask, max_retries=3)
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


@shared_task(name=TAKE_TASK, bind=True, acks_late=False)
def take_rows(self: Task, job: str, batch: int) -> dict[str, Any]:
    """Generate the unsent rows of another GPU's ``batch`` that its owner grants this worker.

    Acked when taken: whatever happens to this run, the batch's owner sends the rows its part
    did not answer (workers/split/), so there is nothing to redeliver."""
    try:
        return asyncio.run(_take(self, job, batch))
    except (HandBack, JobStopped, LostOwnership, JobError) as exc:
        log.warning("rows of batch %s/%s given back: %s", job, batch, exc)
        return _skipped(job, batch, str(exc))
