"""Live job state in Redis: the job's registration, its counters and its workers' stall notes.

Redis holds only what can be rebuilt: the store has the job record, the staged inputs and the
results. Counters are bumped in the same Lua call that records a row (``scripts.record_rows``),
only the first time a row is recorded and only from the batch's current owner, so a
redelivered batch never counts a prompt twice. There is no "pending" mark: where a batch is
(queued, held, done) is derived from the broker and the owner keys when it matters
(workers/delivery/whereabouts.py).

Every key name is in workers/redisdb/keys.py, every script in workers/redisdb/lua/.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis

from workers.redisdb import scripts
from workers.redisdb.keys import JOBS_KEY, JobKeys

# Per-batch counters ("{batch}|{field}" in the job's bstats hash) mirror what each batch adds to
# the job's stats, so a batch's contribution can be replaced exactly (set_batch_counts) when the
# store says otherwise: the counters stay equal to what the store holds plus the open batches.
COUNT_FIELDS = ("completed", "failed", "quarantined", "truncated", "output_tokens")
# The job hash's fields a split's grant counts (workers/redisdb/lua/grant_part.lua): parts
# granted at the job's end, and their rows.
SPLIT_FIELDS = ("parts_granted", "rows_split")

# How long a worker's "cannot read the job" note stands without being renewed.
STALL_NOTE_S = 90.0


async def note_stalled(r: aioredis.Redis, job: str, node: str, why: str) -> None:
    """Record that ``node`` cannot work on ``job`` (``why``: one line for ``status``)."""
    key = JobKeys(job).stalled
    async with r.pipeline() as pipe:
        pipe.hset(key, node, orjson.dumps({"why": why, "at": round(time.time(), 3)}))
        pipe.expire(key, int(STALL_NOTE_S))
        await pipe.execute()


def record_profile(r: redis.Redis, job: str, profile: str,
                   needs: dict[str, str | None]) -> None:
    """The launch profile a job was enqueued for and the output flags it needs an engine to
    run with (config/launch_profile.py OUTPUT_FLAGS); workers with other values refuse it."""
    r.hset(JobKeys(job).job, mapping={"profile": profile, "needs": orjson.dumps(needs)})


async def clear_stalled(r: aioredis.Redis, job: str, node: str) -> None:
    """``node`` can read the job again."""
    await r.hdel(JobKeys(job).stalled, node)


def stalled_notes(r: redis.Redis, job: str) -> list[str]:
    """``node why`` for every worker that noted, within STALL_NOTE_S, that it cannot work on
    ``job``."""
    now, out = time.time(), []
    for node, raw in sorted(r.hgetall(JobKeys(job).stalled).items()):
        note = orjson.loads(raw)
        if now - float(note.get("at", 0)) <= STALL_NOTE_S:
            out.append(f"{node.decode()} {note.get('why', '')}")
    return out


def register_job(r: redis.Redis, job: str, spec_json: str, store_url: str | None = None
                 ) -> None:
    """Record the job in Redis as running (idempotent; keeps the first start time), and where
    its store is (``store_url``), so every command finds it from any directory."""
    keys = JobKeys(job)
    pipe = r.pipeline()
    pipe.sadd(JOBS_KEY, job)
    fields = {"spec": spec_json, "state": "running"}
    if store_url:
        fields["store_url"] = store_url
    pipe.hset(keys.job, mapping=fields)
    pipe.hsetnx(keys.job, "started_at", time.time())
    pipe.execute()


def batch_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """What stored rows add to the job's counters (failed and quarantined are disjoint, as in
    ``verify`` and the manifest)."""
    from workers.dataset.manifest import (
        row_bucket,  # pyarrow: kept off the status command's imports
    )

    out = dict.fromkeys(COUNT_FIELDS, 0)
    for row in rows:
        kind = row_bucket(row)
        if kind in ("failed", "quarantined"):
            out[kind] += 1
        else:
            out["completed"] += 1
            out["truncated"] += kind == "truncated"
        out["output_tokens"] += int(row.get("completion_tokens") or 0)
    return out


def set_batch_counts(r: redis.Redis | redis.client.Pipeline, job: str, batch: int,
                     counts: dict[str, int]) -> None:
    """Make ``batch``'s contribution to the job's counters exactly ``counts``."""
    scripts.set_batch_counts(r, job, batch, [(f, int(counts.get(f, 0))) for f in COUNT_FIELDS])


def counters(r: redis.Redis, job: str) -> dict[str, int]:
    """The job's live counters as integers (missing ones are 0)."""
    raw = r.hgetall(JobKeys(job).stats)
    return {n: int(raw.get(n.encode(), 0)) for n in COUNT_FIELDS}
