"""Where a job's data lives: on this node (lost when a rented node is returned) or off it.

A store is **on the node** when it is a folder (``file://``) or an S3 endpoint served from
the node itself: the compose MinIO service (``http://minio:9000``), ``localhost``, a loopback
or link-local address, or this host's own name. An empty endpoint means AWS S3 and any other
endpoint host is taken as a store elsewhere. ``enqueue`` refuses a job whose store is on the
node unless the operator says so with ``FLEET_ALLOW_NODE_LOCAL_STORE=1`` (or
``enqueue --allow-node-local-store``); ``status`` reports the location either way. The
runbook (docs/runbook.md, "Copy a MinIO run off the node") has the step that saves such a run.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from workers.errors import JobError

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
