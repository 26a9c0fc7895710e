"""The consumer bootstep of the elastic hold (workers/delivery/hold.py).

It runs right after Celery's task-consumer step (``celery.worker.consumer.tasks:Tasks``) has
made the consumer's ``QoS`` at ``worker_concurrency`` × the prefetch multiplier, and before the
event loop reads a message: it sets the prefetch count to 1, so a starting worker takes one
batch, then starts the thread that raises it while the batches held leave the engine room.
A reconnect makes a new ``QoS``; the step runs again with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import MethodType
from typing import Any

import redis
from celery import bootsteps
from celery.worker import state

from config.settings import load_settings
from workers.delivery.hold import ElasticHold, apply
from workers.node import context
from workers.node.queues import BATCH_TASK, SINK_QUEUE, TAKE_TASK
from workers.split.asker import SplitAsker

log = logging.getLogger(__name__)


class HoldStep(bootsteps.StartStopStep):
    """One batch at start; more while the held batches have nothing left to send."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.hold: ElasticHold | None = None

    def start(self, c: Any) -> None:
        """Prefetch 1, then the hold's thread (GPU workers only)."""
        if list(c.app.amqp.queues.consume_from or {}) == [SINK_QUEUE]:
            return  # a sink-only worker takes sink tasks as Celery does
        apply(c.qos, 1)
        c.qos.update()
        if self.hold is None:
            settings = load_settings()
            client = redis.Redis.from_url(settings.redis_url.get_secret_value(),
                                          **settings.redis_client_options())
            queues = [q for q in (c.app.amqp.queues.consume_from or {}) if q != SINK_QUEUE]
            self.hold = ElasticHold(client, context.identity().node,
                                    lambda: getattr(c, "qos", None), held_batches,
                                    settings.batches_per_gpu,
                                    SplitAsker(c.app, client, queues, settings.split_min_rows),
                                    _waker(c))
            self.hold.start()
            log.info("elastic hold: one batch at a time, up to %d", settings.batches_per_gpu)
        _limit_reads(c.task_consumer.channel.qos, self.hold)

    def shutdown(self, c: Any) -> None:
        """Stop the thread."""
        if self.hold is not None:
            self.hold.stop()


def held_batches() -> frozenset[str]:
    """Ids of the batch messages (and parts of batches) this worker has reserved and not
    finished (sink tasks not counted)."""
    return frozenset(req.id for req in state.reserved_requests
                     if req.name in (BATCH_TASK, TAKE_TASK))


def _waker(c: Any) -> Callable[[], None] | None:
    """Wake the consumer's event loop from the hold's thread: kombu's ``Hub.call_soon`` is
    thread-safe and writes to the loop's waker pipe (kombu 5.7, ``asynchronous/hub.py``)."""
    hub = getattr(c, "hub", None)
    if hub is None:
        return None
    return lambda: hub.call_soon(_nothing)


def _nothing() -> None:
    """The wake's callback: the loop's next pass is the point."""


def _limit_reads(channel_qos: Any, hold: ElasticHold) -> None:
    """Wrap the channel's ``can_consume``: nothing is read unless the hold allows one."""
    original = channel_qos.can_consume

    def can_consume(self: Any) -> bool:
        if not hold.may_take():
            return False
        return bool(original())

    channel_qos.can_consume = MethodType(can_consume, channel_qos)
