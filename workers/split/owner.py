"""The batch owner's side of a split: what it has not sent yet, its answer to an idle GPU
asking for those rows, and the parts of its batch still live.

Every unit of a pass is a coroutine waiting on the batch's limiter; a unit counts as sent once
it holds a slot (:meth:`RowSplitter.take`). A unit granted to a part is skipped when its slot
comes: the part's worker sends it, or, if that part lapses, the owner's next pass does.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from workers.delivery.ownership import Ownership
from workers.redisdb import scripts
from workers.redisdb.keys import JobKeys
from workers.split.protocol import PARTS_TTL_S, Request

log = logging.getLogger(__name__)


def rows_to_move(unsent: int, in_flight: int) -> int:
    """How many unsent rows the owner gives: as many as leave both GPUs about the same work
    (its in-flight requests stay its own), at most all it has not sent."""
    return min(unsent, math.ceil((unsent + in_flight) / 2))


async def open_request(r: aioredis.Redis, job: str, batch: int) -> Request | None:
    """The batch's open split request, if any."""
    raw = await r.get(JobKeys(job).split_request(batch))
    return Request.decode(raw) if raw else None


async def grant(r: aioredis.Redis, job: str, batch: int, owner_token: str, req: Request,
                unit_keys: list[str], ttl_s: float) -> int:
    """Give ``unit_keys`` to the asker of ``req``: -1 when ``owner_token`` does not own the
    batch, 0 when the request changed or is gone, 1 when granted."""
    return int(await scripts.grant_part(r, job, batch, owner_token, req.raw, req.part,
                                        unit_keys, int(ttl_s * 1000), PARTS_TTL_S))


async def refuse(r: aioredis.Redis, job: str, batch: int, req: Request) -> None:
    """Drop ``req`` (nothing worth moving): its asker stops waiting at once."""
    await scripts.release_if_owner(r, JobKeys(job).split_request(batch), req.raw)


async def live_part_rows(r: aioredis.Redis, job: str, batch: int) -> frozenset[str]:
    """Unit keys held by the batch's live parts (their claims not lapsed nor released)."""
    k = JobKeys(job)
    parts = [p.decode() for p in await r.smembers(k.parts(batch))]
    if not parts:
        return frozenset()
    live = await r.mget([k.part(batch, p) for p in parts])
    held: set[str] = set()
    for part, claim in zip(parts, live, strict=True):
        if claim is not None:
            held |= {x.decode() for x in await r.smembers(k.part_rows(batch, part))}
    return frozenset(held)


async def drop_parts(r: aioredis.Redis, job: str, batch: int) -> None:
    """Forget the batch's parts once its result is written (each has ended by then)."""
    k = JobKeys(job)
    parts = [p.decode() for p in await r.smembers(k.parts(batch))]
    keys = [k.parts(batch)]
    for p in parts:
        keys += [k.part(batch, p), k.part_rows(batch, p)]
    await r.delete(*keys)


class RowSplitter:
    """Which units of the running pass are unsent, and moving them to a part."""

    def __init__(self, r: aioredis.Redis, job: str, batch: int, owner: Ownership,
                 ttl_s: float, min_rows: int) -> None:
        self.redis, self.job, self.batch, self.owner = r, job, batch, owner
        self.ttl_s, self.min_rows = ttl_s, min_rows
        self._pass: list[str] = []
        self.started: set[str] = set()
        self.moved: set[str] = set()

    def begin(self, unit_keys: Iterable[str]) -> None:
        """A pass starts with these units (none of them sent; none in a live part)."""
        self._pass = list(unit_keys)
        self.started.clear()
        self.moved.clear()

    def take(self, unit_key: str) -> bool:
        """Whether the owner sends this unit now (False: a part holds it)."""
        if unit_key in self.moved:
            return False
        self.started.add(unit_key)
        return True

    def unsent(self) -> list[str]:
        """Units of the pass that hold no slot yet and were not moved, in the pass's order."""
        return [k for k in self._pass if k not in self.started and k not in self.moved]

    async def answer(self, in_flight: int, busy: bool) -> int:
        """Answer the batch's open split request, if any: grant the last of the unsent units
        (:func:`rows_to_move`), or refuse when fewer than ``min_rows`` are unsent or the
        batch isolates crash suspects (``busy``). Returns the units moved."""
        if self.min_rows <= 0:
            return 0
        try:
            req = await open_request(self.redis, self.job, self.batch)
            if req is None:
                return 0
            unsent = self.unsent()
            n = rows_to_move(len(unsent), in_flight)
            if busy or n < self.min_rows:
                await refuse(self.redis, self.job, self.batch, req)
                return 0
            moving = unsent[len(unsent) - n:]
            # Marked before the grant's round trip: no slot handed out meanwhile sends them.
            # Should the grant not happen, those skipped meanwhile are missing at the end of
            # the pass and the next pass sends them.
            self.moved.update(moving)
            t0 = time.monotonic()
            answer = await grant(self.redis, self.job, self.batch, self.owner.token, req,
                                 moving, self.ttl_s)
        except (RedisError, OSError) as exc:
            log.debug("split request of %s/%d not answered: %s", self.job, self.batch, exc)
            return 0
        if answer != 1:
            self.moved.difference_update(moving)
            return 0
        log.info("batch %s/%d: %d unsent rows moved to part %s (%.0f ms)", self.job, self.batch,
                 len(moving), req.part, (time.monotonic() - t0) * 1000)
        return len(moving)
