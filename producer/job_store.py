"""Which store a command reads for a job: the one the job was enqueued into.

``enqueue`` records the job's store URL in its Redis hash (``store_url``), so ``status``,
``verify``, ``export``, ``report``, ``sink`` and the rest find the job from any directory: the
default store (``fleet-data`` under the current directory) would otherwise depend on where the
command is run. A ``FLEET_STORE_URL`` that the operator set and that names another store is
refused with one line, rather than reading (or writing) the wrong place.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

import redis

from config.settings import Settings
from workers.delivery import jobstate
from workers.errors import JobError


def canonical(url: str) -> str:
    """A store URL in one spelling: ``file://`` paths absolute and resolved, no trailing ``/``."""
    parsed = urlparse(url)
    if parsed.scheme in ("file", ""):
        raw = unquote(parsed.netloc + parsed.path) if parsed.scheme else url
        return Path(raw).expanduser().resolve().as_uri()
    return url.rstrip("/")


def recorded_store(r: redis.Redis, job: str) -> str | None:
    """The store URL ``enqueue`` recorded for ``job`` (None: unknown to Redis, or a job
    enqueued before stores were recorded)."""
    raw = r.hget(jobstate.Keys(job).job, "store_url")
    return raw.decode() if raw else None


def for_job(settings: Settings, job: str, r: redis.Redis | None = None) -> Settings:
    """``settings`` with the job's own store. Where Redis cannot be reached or does not know
    the job, the settings' store stands (a command that needs Redis says so itself)."""
    client = r or redis.Redis.from_url(settings.redis_url.get_secret_value(),
                                       socket_connect_timeout=2, socket_timeout=5)
    try:
        recorded = recorded_store(client, job)
    except redis.RedisError:
        recorded = None
    finally:
        if r is None:
            client.close()
    if recorded is None or canonical(recorded) == canonical(settings.store_url):
        return settings
    if "store_url" in settings.model_fields_set:
        raise JobError(f"job {job!r} is in the store {recorded}, but FLEET_STORE_URL names "
                       f"{settings.store_url}: unset FLEET_STORE_URL or set it to {recorded}")
    return settings.model_copy(update={"store_url": recorded})
