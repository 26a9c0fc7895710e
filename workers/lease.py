"""Renew the Redis visibility lease of the batches this worker holds.

kombu's Redis transport emulates acks with a sorted set (``unacked_index``) scored by delivery
time; any worker's sweep requeues entries older than ``visibility_timeout``. A fixed timeout
cannot both recover a dead worker's batch quickly and never re-run a live, slow one
(design-notes §2). So the timeout is short and the main process of a live worker moves the
score of each batch it holds to "now" every few seconds. If the worker dies (even SIGKILL),
renewal stops and the batch is swept back within ``visibility_timeout + sweep interval``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
from celery.worker import state as worker_state

log = logging.getLogger(__name__)


def held_delivery_tags() -> list[str]:
    """Delivery tags of every message this worker has reserved (running or about to)."""
    for _ in range(5):
        try:
            requests = list(worker_state.requests.values())
            break
        except RuntimeError:  # the dict changed while we copied it; try again
            continue
    else:
        return []
    # Request.delivery_info drops the tag; the kombu message keeps it.
    tags = [getattr(r.message, "delivery_tag", None) for r in requests]
    return [t for t in tags if t]


def renew(client: redis.Redis, index_key: str, tags: list[str], now: float) -> int:
    """Move the lease of each still-unacked tag to ``now`` (XX: never re-adds an acked one)."""
    if not tags:
        return 0
    return int(client.zadd(index_key, {t: now for t in tags}, xx=True, ch=True) or 0)


class LeaseKeeper(threading.Thread):
    """Background thread that renews this worker's leases every ``interval_s``."""

    def __init__(self, client: redis.Redis, index_key: str, interval_s: float) -> None:
        super().__init__(name="fleet-lease", daemon=True)
        self._client, self._key, self._interval = client, index_key, interval_s
        self._stop_event = threading.Event()

    def run(self) -> None:
        """Renew until stopped; a Redis error is logged and retried next round."""
        while not self._stop_event.wait(self._interval):
            try:
                renew(self._client, self._key, held_delivery_tags(), time.time())
            except redis.RedisError as exc:
                log.warning("lease renewal failed: %s", exc)

    def stop(self) -> None:
        """Stop renewing."""
        self._stop_event.set()


def index_key(app: Any) -> str:
    """Name of kombu's unacked index for ``app``'s broker (``unacked_index`` by default)."""
    opts = app.conf.broker_transport_options or {}
    return str(opts.get("unacked_index_key", "unacked_index"))
