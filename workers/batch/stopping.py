"""Why a running batch must stop before it is done: its job cancelled, its claim lost, its
worker process gone or its worker handing its batches back."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable

from redis.exceptions import RedisError

from workers.aio import cancel_and_wait
from workers.batch.units import HandBack, JobStopped
from workers.delivery.ownership import Ownership
from workers.delivery.progress import BatchEnv
from workers.redisdb.keys import JobKeys, NodeKeys


class StopWatch:
    """Runs a batch's work and stops it within about a second when it must stop."""

    def __init__(self, env: BatchEnv, job: str, batch: int, owner: Ownership) -> None:
        self.env, self.job, self.batch, self.owner = env, job, batch, owner
        self._parent = os.getppid()  # the worker's main process (Celery's pool parent)

    async def run(self, work: Awaitable[None]) -> None:
        """Run ``work``; cancel it and raise the reason once the run must stop."""
        task = asyncio.ensure_future(work)
        while not task.done():
            await asyncio.wait({task}, timeout=1.0)
            if task.done():
                break
            stop = self.owner.lost() or await self.reason()
            if stop is not None:
                await cancel_and_wait(task)
                raise stop
        task.result()

    async def reason(self) -> Exception | None:
        """Why this run must stop now, if it must (a failing Redis is not a reason here: the
        claim's keeper bounds how long the run goes on without Redis)."""
        try:
            state, handback = await asyncio.gather(
                self.env.redis.hget(JobKeys(self.job).job, "state"),
                self.env.redis.exists(NodeKeys(self.env.me.node).handback))
        except (RedisError, OSError):
            return None
        if state == b"cancelled":
            return JobStopped(f"job {self.job} cancelled")
        if os.getppid() != self._parent:
            return HandBack(f"the worker process of batch {self.batch} is gone: its claim is "
                            "given up for the redelivery")
        if handback:
            return HandBack(f"worker {self.env.me.node} is stopping: batch {self.batch} "
                            "handed back with its answered prompts kept")
        return None
