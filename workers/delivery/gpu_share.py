"""One in-flight budget per GPU, shared by the batches on it, oldest batch first.

"GPU" here is the worker's engine: one GPU, or a GPU group served by one tensor-parallel
engine (workers/node/gpu_group.py). The budget is per worker either way (the node's hash below),
and its cap is that engine's effective cap (summed over DP ranks, workers/engine/client.py).

Two batches on one GPU that each keep the engine's cap in flight start together, drain
together and reach their tails together, so the engine empties at the end of every round.
Here the oldest batch may use the whole budget and each younger batch gets what the older ones
do not claim. A batch claims the prompts it has not finished (counted up to the budget), so a
younger batch only sends while the older ones are in their tails: the engine stays full
whenever any batch on the GPU has unsent prompts, and the batches fall out of phase by
construction.

Claims live in the node's in-flight hash (``NodeKeys.in_flight``), one field per batch,
which the worker's heartbeat also sums. A claim not refreshed for ``STALE_S`` is ignored: the
process that wrote it is gone.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import orjson
import redis.asyncio as aioredis

from workers.redisdb.keys import NodeKeys

STALE_S = 3.0
KEY_TTL_S = 30


@dataclass(frozen=True)
class Claim:
    """What one batch on the GPU holds and wants."""

    tag: str
    started: float
    claim: int
    in_flight: int
    at: float
    # Isolating suspects of a crash: the batch needs the engine to itself.
    exclusive: bool = False
    # The GPU's in-flight budget as this batch sees it (0: not published).
    budget: int = 0

    @property
    def unsent(self) -> int:
        """Prompts of this batch not finished and not in flight: what it still has to send."""
        return max(self.claim - self.in_flight, 0)

    @property
    def rank(self) -> tuple[float, str]:
        """Older batches come first."""
        return (self.started, self.tag)

    def encode(self) -> bytes:
        """The hash field's value."""
        return orjson.dumps({"started": self.started, "claim": self.claim,
                             "in_flight": self.in_flight, "at": self.at,
                             "exclusive": self.exclusive, "budget": self.budget})

    @classmethod
    def decode(cls, tag: str, raw: bytes) -> Claim | None:
        """None for a value this code did not write."""
        try:
            d = orjson.loads(raw)
            return cls(tag, float(d["started"]), int(d["claim"]), int(d["in_flight"]),
                       float(d["at"]), bool(d.get("exclusive", False)),
                       int(d.get("budget", 0)))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None


def decode_all(raw: dict[bytes, bytes]) -> list[Claim]:
    """Every readable claim of a node's hash."""
    claims = (Claim.decode(k.decode(), v) for k, v in raw.items())
    return [c for c in claims if c is not None]


def _others(mine: Claim, claims: Iterable[Claim], now: float) -> list[Claim]:
    return [c for c in claims if c.tag != mine.tag and now - c.at <= STALE_S]


def allowed(mine: Claim, claims: Iterable[Claim], budget: int, now: float) -> int:
    """Requests this batch may have in flight: the budget less what older live batches claim.
    While a batch isolates crash suspects (exclusive) the others get nothing; of two exclusive
    batches the older goes first."""
    others = _others(mine, claims, now)
    exclusive = [c.rank for c in others if c.exclusive]
    if exclusive and not (mine.exclusive and mine.rank < min(exclusive)):
        return 0
    if mine.exclusive:
        return budget
    older = sum(min(c.claim, budget) for c in others if c.rank < mine.rank)
    return max(budget - older, 0)


def others_in_flight(mine: Claim, claims: Iterable[Claim], now: float) -> int:
    """Requests the other live batches on the GPU have in flight."""
    return sum(c.in_flight for c in _others(mine, claims, now))


def in_flight_total(raw: dict[bytes, bytes], now: float) -> int:
    """Requests in flight on the node, from its live claims (for the heartbeat)."""
    return sum(c.in_flight for c in decode_all(raw) if now - c.at <= STALE_S)


class GpuShare:
    """This batch's place in its GPU's budget."""

    def __init__(self, redis: aioredis.Redis, node: str, tag: str) -> None:
        self.redis, self.tag = redis, tag
        self.key = NodeKeys(node).in_flight
        self.started = time.time()
        self.exclusive = False
        # Requests the GPU's other batches had in flight at the last exchange.
        self.others_in_flight = 0

    async def exchange(self, claim: int, in_flight: int, budget: int) -> int:
        """Publish this batch's claim and return how many requests it may have in flight."""
        now = time.time()
        mine = Claim(self.tag, self.started, claim, in_flight, now, self.exclusive, budget)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.key, self.tag, mine.encode())
            pipe.expire(self.key, KEY_TTL_S)
            pipe.hgetall(self.key)
            *_, raw = await pipe.execute()
        claims = decode_all(raw)
        self.others_in_flight = others_in_flight(mine, claims, now)
        return allowed(mine, claims, budget, now)

    async def leave(self) -> None:
        """Drop this batch's claim (it is done, handed back or cancelled)."""
        await self.redis.hdel(self.key, self.tag)
