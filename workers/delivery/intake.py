"""The worker's intake of new batches: stop and restart consuming from its task queues, for as
long as any reason holds.

A GPU whose engine is down (or restarting) or whose leases cannot be renewed must not take
new batches: each would wait for the engine and bounce. The intake cancels the worker's task
queues while at least one reason is set and consumes them again when the last one clears.
Both go through ``Consumer.call_soon`` (Celery 5.7, ``celery.worker.consumer.consumer``),
which runs them on the consumer's own event loop, as Celery's ``cancel_consumer`` and
``add_consumer`` remote-control commands do.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)


class Intake:
    """Closed while any reason is set; the queues it cancelled come back when it opens."""

    def __init__(self, consumer: Any, app: Any) -> None:
        self._consumer, self._app = consumer, app
        self._reasons: set[str] = set()
        self._cancelled: list[str] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Intake closed={sorted(self._reasons)}>"

    @property
    def closed(self) -> bool:
        """Whether the worker is not taking batches now."""
        return bool(self._reasons)

    def is_closed(self, reason: str) -> bool:
        """Whether ``reason`` holds the intake closed."""
        return reason in self._reasons

    def close(self, reason: str) -> None:
        """Stop consuming (if open) and remember ``reason``."""
        with self._lock:
            if reason in self._reasons:
                return
            if not self._reasons:
                self._cancelled = list(self._app.amqp.queues.consume_from or {})
                log.warning("taking no new batches (%s): cancelling %s", reason, self._cancelled)
                for queue in self._cancelled:
                    self._call(self._consumer.cancel_task_queue, queue)
            self._reasons.add(reason)

    def open(self, reason: str) -> None:
        """Forget ``reason``; consume again once no reason is left."""
        with self._lock:
            if reason not in self._reasons:
                return
            self._reasons.discard(reason)
            if not self._reasons:
                log.warning("taking batches again (%s cleared): %s", reason, self._cancelled)
                for queue in self._cancelled:
                    self._call(self._consumer.add_task_queue, queue)

    def _call(self, fn: Any, queue: str) -> None:
        if self._consumer is not None:
            self._consumer.call_soon(fn, queue)
