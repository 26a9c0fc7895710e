"""Cancelling asyncio tasks for sure.

redis-py 8's asyncio client can finish a command normally although its task was cancelled
while the command ran (seen with redis-py 8.1 on Python 3.11: ``eval`` returns its reply and
the ``CancelledError`` is gone), so a loop around Redis calls may outlive one ``cancel()``.
Cancel again until the task is done.
"""

from __future__ import annotations

import asyncio

RECANCEL_S = 0.2


async def cancel_and_wait(*tasks: asyncio.Future[object]) -> None:
    """Cancel ``tasks`` and wait until each is done, cancelling again while one runs on."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for t in tasks:  # retrieve outcomes so none is reported as never retrieved
        if not t.cancelled():
            t.exception()
