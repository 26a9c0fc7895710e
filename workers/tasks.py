"""The batch task: thin Celery glue around :class:`workers.batch_runner.BatchRunner`."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import redis.asyncio as aioredis
from celery import shared_task
from celery.exceptions import Reject

from config.settings import Settings, load_settings
from workers import jobstate
from workers.batch_runner import BatchEnv, BatchRunner, EngineDown
from workers.context import identity
from workers.heartbeat import heartbeat_key
from workers.jobs import load_batch_input, load_spec, result_key
from workers.store import Store, open_store


@functools.lru_cache(maxsize=1)
def _settings_and_store() -> tuple[Settings, Store]:
    settings = load_settings()
    return settings, open_store(settings.store_url, settings.s3)


async def _run(job: str, batch: int) -> dict[str, Any]:
    settings, store = _settings_and_store()
    me = identity()
    r = aioredis.from_url(settings.redis_url.get_secret_value())
    try:
        if await r.sismember(jobstate.Keys(job).done, batch):
            return {"job": job, "batch": batch, "skipped": "already done"}
        spec = await asyncio.to_thread(load_spec, store, job)
        if await asyncio.to_thread(store.exists, result_key(job, batch)):
            # Results are durable but Redis lost the "done" mark (a restart): just record it.
            await r.sadd(jobstate.Keys(job).done, batch)
            await r.srem(jobstate.Keys(job).pending, batch)
            return {"job": job, "batch": batch, "skipped": "results already stored"}
        rows = await asyncio.to_thread(load_batch_input, store, job, batch)
        beat = await r.get(heartbeat_key(me.node))
        profile = _profile_name(beat, settings.profile)
        env = BatchEnv(settings=settings, me=me, store=store, redis=r, profile=profile)
        return await BatchRunner(env, spec, batch, rows).run()
    finally:
        await r.aclose()


def _profile_name(beat: bytes | None, default: str) -> str:
    import orjson

    return str(orjson.loads(beat).get("profile", default)) if beat else default


@shared_task(name="fleet.run_batch", bind=True)
def run_batch(self: Any, job: str, batch: int) -> dict[str, Any]:
    """Generate every prompt of ``batch`` of ``job`` and store the results."""
    try:
        return asyncio.run(_run(job, batch))
    except EngineDown as exc:
        # Another GPU can take it: back of the queue, not a failure.
        raise Reject(str(exc), requeue=True) from exc
