"""The end of a batch's run: its answered rows read back, written as its result, the batch
finished under its owner's token (only then is its message acked)."""

from __future__ import annotations

import asyncio
from typing import Any

from celery import current_app
from redis.exceptions import RedisError

from workers.batch.units import units
from workers.dataset.jobs import JobSpec, PromptRow, encode_rows, result_key
from workers.dataset.samples import parse_unit_key, row_unit
from workers.delivery import sink_requests
from workers.delivery.ownership import LostOwnership, Ownership
from workers.delivery.progress import BatchEnv, drop_progress, read_progress
from workers.errors import StoreError
from workers.redisdb import scripts
from workers.redisdb.keys import JobKeys
from workers.split import owner as owner_side


async def collect(env: BatchEnv, spec: JobSpec, batch: int, rows: list[PromptRow]
                  ) -> list[dict[str, Any]]:
    """Every answered row, read from the chunks the progress hash names for its index; a row
    missing from it is a StoreError (the run never writes a result without every row)."""
    raw = await env.redis.hgetall(JobKeys(spec.name).progress(batch))
    out = await asyncio.to_thread(read_progress, env.store, spec.name, batch,
                                  {parse_unit_key(i): c.decode() for i, c in raw.items()})
    expected = [(u.index, u.sample) for u in units(spec, rows)]
    if [row_unit(r) for r in out] != expected:
        missing = sorted(set(expected) - {row_unit(r) for r in out})
        raise StoreError(f"batch {batch} progress lost rows {missing[:10]}")
    return out


async def finish(env: BatchEnv, spec: JobSpec, batch: int, rows: list[PromptRow],
                 owner: Ownership) -> list[dict[str, Any]]:
    """Write the batch's result (env.store retries) while ``owner`` still holds it, mark it
    done, drop its progress and parts, and ask for the sink once the job is complete. Returns
    the rows written."""
    out = await collect(env, spec, batch, rows)
    if (lost := owner.lost()) is not None:
        raise lost
    if not await owner.still_owned():
        raise LostOwnership(f"batch {spec.name}/{batch} is owned by another run")
    data = encode_rows(out, compress=False)
    await asyncio.to_thread(env.store.put, result_key(spec.name, batch), data)
    finished = await scripts.finish_batch(env.redis, spec.name, batch, owner.token)
    if not finished:
        raise LostOwnership(f"batch {spec.name}/{batch} was taken over while its result was "
                            "written (the new owner writes it again)")
    await asyncio.to_thread(drop_progress, env.store, spec.name, batch)
    try:
        await owner_side.drop_parts(env.redis, spec.name, batch)
    except (RedisError, OSError):
        pass  # the part lists expire by themselves
    await sink_requests.trigger_when_done(env.redis, current_app, spec, env.settings)
    return out
