"""``python -m producer sink``: run the sink here, or enqueue it for a sink worker and wait."""

from __future__ import annotations

from typing import Any

import redis

from config.settings import Settings
from workers.sink import ShardLimits, aggregate, request_sink, wait_sink
from workers.store import open_store, store_policy


def run_sink(settings: Settings, job: str, wait: bool, local: bool, timeout_s: float
             ) -> dict[str, Any] | None:
    """Aggregate ``job``: in-process (``local``), or through the ``sink`` queue."""
    store = open_store(settings.store_url, settings.s3)
    if local:
        return aggregate(store, job, ShardLimits.from_settings(settings), store_policy(settings))
    from workers import app
    from workers.jobs import load_spec

    load_spec(store, job)  # a clear error for an unknown job, before anything is queued
    r = redis.Redis.from_url(settings.redis_url.get_secret_value())
    try:
        request = request_sink(r, app, job)
        return wait_sink(r, job, request, timeout_s) if wait else None
    finally:
        r.close()
