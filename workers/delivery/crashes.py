"""Engine crashes seen from a batch: which prompts were in flight, and which are poison.

A prompt that crashes the engine would otherwise crash it again on every redelivery. Each
crash (a restart the worker's monitor made because the engine died, hung or failed its
health checks, not a tuner relaunch) adds one to the crash count of the prompts that were in
flight; counts live in Redis so they survive a redelivery. A prompt whose count reaches the
threshold is quarantined with its reason. See BatchRunner for how suspects are bisected.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from workers.redisdb.keys import JobKeys, NodeKeys


class CrashTracker:
    """Crash counts per prompt of one job, and the restart counter of this worker's engine."""

    def __init__(self, redis: aioredis.Redis, job: str, node: str, threshold: int) -> None:
        self._redis, self._node, self.threshold = redis, node, threshold
        self._key = JobKeys(job).crashes

    async def counts(self, indices: list[int]) -> dict[int, int]:
        """Crash count of each index (0 when never in flight at a crash)."""
        if not indices:
            return {}
        raw = await self._redis.hmget(self._key, [str(i) for i in indices])
        return {i: int(v or 0) for i, v in zip(indices, raw, strict=True)}

    async def add(self, indices: list[int]) -> None:
        """One more crash for each of ``indices``."""
        if indices:
            pipe = self._redis.pipeline()
            for i in indices:
                pipe.hincrby(self._key, str(i), 1)
            await pipe.execute()

    async def crash_restarts(self) -> int:
        """How many times this worker's engine was restarted because it crashed or hung."""
        raw = await self._redis.hget(NodeKeys(self._node).stats, "crash_restarts")
        return int(raw or 0)
