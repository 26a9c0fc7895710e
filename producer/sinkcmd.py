"""``python -m producer sink``: run the sink here (``--local``: the sink task's run, state and
retries in this process), or ask a worker's ``sink`` queue for it and wait;
``python -m producer dataset-path``: where the committed data set is."""

from __future__ import annotations

import uuid
from typing import Any

import redis

from config.settings import Settings
from workers.dataset.manifest import committed_prefix, location
from workers.dataset.sink_lock import SinkLock
from workers.dataset.store import open_store
from workers.delivery.sink_requests import request_sink, wait_sink


def run_sink(settings: Settings, job: str, wait: bool, local: bool, timeout_s: float
             ) -> dict[str, Any] | None:
    """Aggregate ``job``: in-process (``local``, under the job's data-set lock, waiting up to
    ``timeout_s`` for it), or through the ``sink`` queue."""
    from workers.dataset.jobs import load_spec

    store = open_store(settings.store_url, settings.s3)
    load_spec(store, job)  # a clear error for an unknown job, before anything else
    r = redis.Redis.from_url(settings.redis_url.get_secret_value())
    try:
        if local:
            from workers.wiring.sink_task import sink_here

            request = f"local-{uuid.uuid4().hex}"
            with SinkLock(r, job, request) as lock:
                lock.acquire(timeout_s)
                return sink_here(r, job, lock, request)
        from workers import app

        request = request_sink(r, app, job)
        return wait_sink(r, job, request, timeout_s) if wait else None
    finally:
        r.close()


def dataset_path(settings: Settings, job: str, allow_incomplete: bool = False) -> str:
    """Path (local store) or URL (S3) of the committed version of ``job``'s data set: a folder
    that holds exactly that version's shards (JobError if there is none, or it is incomplete
    and ``allow_incomplete`` is not set)."""
    from workers.dataset.jobs import load_spec

    store = open_store(settings.store_url, settings.s3)
    load_spec(store, job)  # "no job ..." for a job that is not there
    return location(store.url, committed_prefix(store, job, allow_incomplete))
