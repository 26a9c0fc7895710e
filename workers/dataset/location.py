"""Where a job's data lives: on this node (lost when a rented node is returned) or off it.

A store is **on the node** when it is a folder (``file://``) or an S3 endpoint served from
the node itself: the compose MinIO service (``http://minio:9000``), ``localhost``, a loopback
or link-local address, or this host's own name. An empty endpoint means AWS S3 and any other
endpoint host is taken as a store elsewhere. ``enqueue`` refuses a job whose store is on the
node unless the operator says so with ``FLEET_ALLOW_NODE_LOCAL_STORE=1`` (or
``enqueue --allow-node-local-store``); ``status`` reports the location either way. The
runbook (docs/runbook.md, "Copy a MinIO run off the node") has the step that saves such a run.

It is also the one answer to **which store holds a job**, for every process (workers, the
sink task, the CLI): ``enqueue`` records the job's store URL in the job's Redis hash
(``store_url``) and :func:`job_store_url` reads it back, so a job is found from any folder and
by a worker started anywhere; the default store (``fleet-data`` under the current folder)
would otherwise depend on where each process was started. :func:`check_not_repointed` keeps
``enqueue`` from moving an existing job to another store.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse, urlsplit

import redis

from config.settings import Settings
from workers.errors import JobError
from workers.redisdb.keys import JobKeys

# Compose service names of a store that runs on the node (deploy/compose_gen.py: minio).
NODE_SERVICES = frozenset({"minio", "localhost"})
ON_NODE, OFF_NODE = "node", "off-node"


@dataclass(frozen=True)
class StoreLocation:
    """Where the store is and why the fleet thinks so."""

    where: str  # "node" or "off-node"
    store_url: str
    endpoint: str | None
    why: str

    @property
    def on_node(self) -> bool:
        """Whether the data is lost when this node goes back."""
        return self.where == ON_NODE

    @property
    def tls(self) -> bool | None:
        """Whether the store is reached over TLS (None for a folder)."""
        if self.store_url.startswith("file:"):
            return None
        return self.endpoint is None or self.endpoint.startswith("https://")

    def to_json(self) -> dict[str, str | bool | None]:
        """The ``store`` object of ``status --json``."""
        return {"where": self.where, "url": self.store_url, "endpoint": self.endpoint,
                "tls": self.tls, "why": self.why}


def _local_host(host: str) -> bool:
    """Whether ``host`` names this node (service name, loopback, link-local, own name)."""
    host = host.strip("[]").lower()
    if host in NODE_SERVICES or host in {socket.gethostname().lower(), socket.getfqdn().lower()}:
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_link_local or ip.is_unspecified


def locate(store_url: str, endpoint_url: str | None) -> StoreLocation:
    """Where ``store_url`` (with the S3 ``endpoint_url``, if any) keeps its data."""
    scheme = urlsplit(store_url).scheme
    if scheme == "file":
        return StoreLocation(ON_NODE, store_url, None, "a folder on this machine")
    if not endpoint_url:
        return StoreLocation(OFF_NODE, store_url, None, "AWS S3 (no endpoint set)")
    host = urlsplit(endpoint_url).hostname or ""
    if _local_host(host):
        return StoreLocation(ON_NODE, store_url, endpoint_url,
                             f"S3 endpoint {host} is served from this node (MinIO?)")
    clear = "" if endpoint_url.startswith("https://") else " over plain HTTP (not encrypted)"
    return StoreLocation(OFF_NODE, store_url, endpoint_url, f"S3 endpoint {host}{clear}")


def require_off_node(loc: StoreLocation, allowed: bool) -> None:
    """Refuse to start a job whose data would stay on the node, unless ``allowed``."""
    if loc.on_node and not allowed:
        raise JobError(
            f"the store {loc.store_url} is on this node ({loc.why}): its results are lost when "
            "the node is returned. Use an off-node store (S3), or set "
            "FLEET_ALLOW_NODE_LOCAL_STORE=1 (or pass --allow-node-local-store) and copy the "
            "run off the node before returning it (README, runbook)")


def canonical(url: str) -> str:
    """A store URL in one spelling: ``file://`` paths absolute and resolved, no trailing ``/``."""
    parsed = urlparse(url)
    if parsed.scheme in ("file", ""):
        raw = unquote(parsed.netloc + parsed.path) if parsed.scheme else url
        return Path(raw).expanduser().resolve().as_uri()
    return url.rstrip("/")


def recorded_store(r: redis.Redis, job: str) -> str | None:
    """The store URL ``enqueue`` recorded for ``job`` (None: unknown to Redis, or a job
    enqueued before stores were recorded). Raises redis errors."""
    raw = r.hget(JobKeys(job).job, "store_url")
    return raw.decode() if raw else None


def job_store_url(r: redis.Redis, job: str, default_url: str, explicit: bool) -> str:
    """The store that holds ``job``: the recorded one, else ``default_url`` (see
    :func:`choose_store`)."""
    return choose_store(job, recorded_store(r, job), default_url, explicit)


def choose_store(job: str, recorded: str | None, default_url: str, explicit: bool) -> str:
    """``recorded`` (the job's store in Redis), else ``default_url``.

    ``explicit`` says the operator named ``default_url`` (FLEET_STORE_URL set): a recorded
    store that differs is then refused with one line rather than reading the wrong place.
    A worker passes ``explicit=False``: its own store setting never overrides the job's."""
    if recorded is None or canonical(recorded) == canonical(default_url):
        return default_url
    if explicit:
        raise JobError(f"job {job!r} is in the store {recorded}, but FLEET_STORE_URL names "
                       f"{default_url}: unset FLEET_STORE_URL or set it to {recorded}")
    return recorded


def for_job(settings: Settings, job: str, r: redis.Redis | None = None) -> Settings:
    """``settings`` with the job's own store (the CLI's and the sink task's view). Where Redis
    cannot be reached or does not know the job, the settings' store stands (a command that
    needs Redis says so itself)."""
    client = r or redis.Redis.from_url(settings.redis_url.get_secret_value(),
                                       socket_connect_timeout=2, socket_timeout=5)
    try:
        url = job_store_url(client, job, settings.store_url,
                            explicit="store_url" in settings.model_fields_set)
    except redis.RedisError:
        url = settings.store_url
    finally:
        if r is None:
            client.close()
    return settings if url == settings.store_url else settings.model_copy(
        update={"store_url": url})


def check_not_repointed(r: redis.Redis, job: str, store_url: str) -> None:
    """Refuse (JobError) to enqueue an existing job into another store than its own."""
    recorded = recorded_store(r, job)
    if recorded is not None and canonical(recorded) != canonical(store_url):
        raise JobError(f"job {job!r} already lives in the store {recorded}, not {store_url}: "
                       f"run enqueue with FLEET_STORE_URL={recorded} (or from the folder it "
                       "was enqueued in), or pick another job name")
