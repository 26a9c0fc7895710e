"""The elastic hold: how many batches a worker may hold now, from what its batches still send.

A worker used to hold a fixed ``worker_concurrency`` of batches (2). When both were fully sent
and waited on their longest prompts, the engine drained until one of them finished. Here the
number of batches a worker holds follows its batches' own state, within the ownership and
lease protocol as it is (each batch is still one Celery message, acked when stored):

- it takes another batch as soon as the batches it holds have nothing left to send but what
  the GPU's in-flight budget still has room for (their unfinished prompts fit in it): the next
  batch is read and ready as they send their last prompts, so the engine never waits on a
  batch boundary (reading a batch's input takes a moment);
- otherwise it takes none: the batches it holds keep the engine full by themselves.

The count is applied as the consumer's prefetch count (kombu's ``QoS``, which Celery's own
autoscaler and ETA handling move the same way) and checked again before each read
(:meth:`ElasticHold.may_take`): at most one message is read per look at the claims, so one
batch at a time is taken and a second GPU gets the next one. The bound
is ``FLEET_BATCHES_PER_GPU`` (the pool's processes): memory and Redis, not the pace.

What each batch sends is read from the node's in-flight hash (workers/delivery/gpu_share.py):
its claim (prompts without an outcome), its requests in flight and the budget it was given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis

from workers.delivery.gpu_share import STALE_S, Claim, decode_all
from workers.redisdb.keys import NodeKeys

log = logging.getLogger(__name__)

POLL_S = 0.1  # one HGETALL of a small hash: cheap, and a batch is taken within it


def has_room(claims: Iterable[Claim]) -> bool:
    """The live batches have less than one in-flight budget left to send between them, none
    isolates suspects, and the requests in flight plus those still to send are under the
    GPU's budget (no claim: room). A batch taken then is ready (its input read, its claim
    published) by the time the others have sent their last prompt, and the GPU's share
    (workers/delivery/gpu_share.py) lets it send only what the older ones leave free."""
    claims = list(claims)
    if not claims:
        return True
    if any(c.exclusive for c in claims):
        return False
    budget = max(c.budget for c in claims)
    return sum(c.in_flight + c.unsent for c in claims) < budget


def wanted(claims: Iterable[Claim], now: float, max_held: int, held: int = 0) -> int:
    """Batches the worker may hold: one more than its live batches when they leave room, else
    as many as it has (at least 1, at most ``max_held``). While one of the ``held`` batches has
    no claim (it is starting, or writing its results), nothing more: what it will send is not
    known yet."""
    live = [c for c in claims if now - c.at <= STALE_S]
    want = len(live) + 1 if has_room(live) and held <= len(live) else len(live)
    return max(1, min(want, max_held))


class ElasticHold:
    """Moves a consumer's prefetch count to :func:`wanted`, every ``POLL_S``, in a thread."""

    def __init__(self, client: redis.Redis, node: str, qos: Callable[[], Any],
                 held: Callable[[], frozenset[str]], max_held: int,
                 idle: Callable[[], None] | None = None,
                 wake: Callable[[], None] | None = None) -> None:
        self.redis, self.key, self.max_held = client, NodeKeys(node).in_flight, max_held
        # Wakes the consumer's event loop. A loop with nothing to read polls its sockets for up
        # to a second between looks at ``can_consume`` (kombu's ``Hub.create_loop``): without
        # the wake, the next batch was read 0.5-1 s after the room for it appeared.
        self._wake = wake
        # Called at each tick while the worker has room for more than it holds (nothing held,
        # or the batches held have nothing left to send and leave the GPU's budget room).
        self._idle = idle
        self._qos = qos  # the consumer's current QoS (a new one after a reconnect)
        self._held = held  # the batches the worker holds now (reserved, not finished): ids
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fleet-hold", daemon=True)
        self.last: int | None = None
        # (batches held, batches wanted) at the last tick: one message at most per tick.
        self.state: tuple[frozenset[str], int] = (frozenset(), 1)

    def may_take(self) -> bool:
        """Whether the consumer may read one more message now (:func:`allows`)."""
        return allows(self.state, self._held())

    def start(self) -> None:
        """Start adjusting (the caller has set the prefetch count to 1 already)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop adjusting; the prefetch count stays where it is."""
        self._stop.set()

    def tick(self) -> int | None:
        """One adjustment; the count set, or None when Redis or the consumer was not there."""
        qos = self._qos()
        if qos is None:
            return None
        held = self._held()  # before the claims: a batch that leaves in between is not missed
        try:
            raw = self.redis.hgetall(self.key)
        except redis.RedisError:
            return None  # keep the count: the batches held go on either way
        want = wanted(decode_all(raw), time.time(), self.max_held, len(held))
        could = allows(self.state, held)  # may_take() before this tick
        self.state = (held, want)
        apply(qos, want)
        if self._wake is not None and not could and len(held) < want:
            self._wake()  # a read is allowed now: let the loop register it at once
        if want > len(held) and self._idle is not None:  # room for more than it holds
            try:
                self._idle()
            except redis.RedisError:
                pass  # the next tick looks again
        if want != self.last:
            log.debug("elastic hold: up to %d batches", want)
            self.last = want
        return want

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.tick()
            except Exception:  # never let the thread die: the worker would stop growing
                log.exception("elastic hold tick failed")


def allows(state: tuple[frozenset[str], int], held: frozenset[str]) -> bool:
    """Whether a tick's ``state`` (batches held, batches wanted) allows one more read now: the
    batches held are the very ones the tick saw (none arrived or left since: a batch that ends
    while another arrives leaves the count as it was, not the claims) and fewer than it
    wanted."""
    seen, want = state
    return held == seen and len(held) < want


def apply(qos: Any, want: int) -> None:
    """Set a kombu ``QoS`` to ``want``: its value (which the consumer's loop applies) and the
    channel's prefetch count."""
    current = int(qos.value or 0)
    if want > current:
        qos.increment_eventually(want - current)
    elif want < current:
        qos.decrement_eventually(current - want)
