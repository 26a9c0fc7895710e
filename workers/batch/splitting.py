"""The batch owner's side of a split (workers/delivery/split.py): what it has not sent yet,
and its answer to an idle GPU asking for those rows.

Every unit of a pass is a coroutine waiting on the batch's limiter; a unit counts as sent once
it holds a slot (:meth:`RowSplitter.take`). A unit granted to a part is skipped when its slot
comes: the part's worker sends it, or, if that part lapses, the owner's next pass does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from workers.delivery import split
from workers.delivery.ownership import Ownership

log = logging.getLogger(__name__)


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
        (:func:`split.rows_to_move`), or refuse when fewer than ``min_rows`` are unsent or the
        batch isolates crash suspects (``busy``). Returns the units moved."""
        if self.min_rows <= 0:
            return 0
        try:
            req = await split.open_request(self.redis, self.job, self.batch)
            if req is None:
                return 0
            unsent = self.unsent()
            n = split.rows_to_move(len(unsent), in_flight)
            if busy or n < self.min_rows:
                await split.refuse(self.redis, self.job, self.batch, req)
                return 0
            moving = unsent[len(unsent) - n:]
            # Marked before the grant's round trip: no slot handed out meanwhile sends them.
            # Should the grant not happen, those skipped meanwhile are missing at the end of
            # the pass and the next pass sends them.
            self.moved.update(moving)
            t0 = time.monotonic()
            answer = await split.grant(self.redis, self.job, self.batch, self.owner.token, req,
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
