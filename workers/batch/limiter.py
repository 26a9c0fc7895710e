"""An async concurrency limit that can change while requests are waiting or running."""

from __future__ import annotations

import asyncio
from types import TracebackType


class Limiter:
    """Like ``asyncio.Semaphore``, but ``set_limit`` may raise or lower the limit at any time
    (the engine came back with another running cap, or another batch on the GPU needs the
    slots). A limit of 0 holds every waiter until it is raised."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.active = 0
        self._cond = asyncio.Condition()

    def __repr__(self) -> str:
        return f"<Limiter {self.active}/{self.limit}>"

    async def __aenter__(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.active < self.limit)
            self.active += 1

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        async with self._cond:
            self.active -= 1
            self._cond.notify(1)  # one slot freed: wake one waiter, not hundreds

    async def set_limit(self, limit: int) -> None:
        """Change the limit; as many waiters are woken as there are free slots."""
        async with self._cond:
            self.limit = max(0, limit)
            self._cond.notify(max(self.limit - self.active, 0))
