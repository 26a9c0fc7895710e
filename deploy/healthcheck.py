"""Container health checks for the compose file (exit 0 healthy, 1 not, one line on stderr).

- ``heartbeat NODE``: the GPU worker ``NODE`` (``gpu3@%h``; ``%h`` is this host's name, as in
  Celery's ``-n``) has a live heartbeat in Redis and its engine is ``healthy``. The heartbeat
  key expires by itself when the worker dies, so a stale worker fails the check.
- ``ping NODE``: the Celery worker ``NODE`` (the sink) answers a remote-control ping.
- ``http URL``: ``URL`` answers 2xx (Flower's unauthenticated ``/healthcheck``).
"""

from __future__ import annotations

import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

import orjson
import redis

TIMEOUT_S = 5.0


def node_name(pattern: str) -> str:
    """Expand ``%h`` to this host's name, as ``celery worker -n`` does."""
    return pattern.replace("%h", socket.gethostname())


def check_heartbeat(node: str) -> str | None:
    """None if ``node``'s heartbeat says its engine is healthy, else why not."""
    from config.settings import load_settings
    from workers.redisdb.keys import NodeKeys

    url = load_settings().redis_url.get_secret_value()
    client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
    try:
        raw = client.get(NodeKeys(node).heartbeat)
    except redis.RedisError as exc:
        return f"cannot read the heartbeat of {node}: {exc}"
    finally:
        client.close()
    if raw is None:
        return f"no live heartbeat from {node}"
    state = orjson.loads(raw).get("engine_state")
    return None if state == "healthy" else f"{node}: engine is {state}"


def check_ping(node: str) -> str | None:
    """None if the Celery worker ``node`` answers a ping."""
    from workers import get_app

    replies = get_app().control.ping(destination=[node], timeout=TIMEOUT_S)
    return None if any(node in reply for reply in replies) else f"{node} did not answer a ping"


def check_http(url: str) -> str | None:
    """None if ``url`` answers with a 2xx status."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
            return None if 200 <= resp.status < 300 else f"{url}: HTTP {resp.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"


CHECKS = {"heartbeat": check_heartbeat, "ping": check_ping, "http": check_http}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one check; exit code 0 when healthy."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in CHECKS:
        print(f"usage: healthcheck.py {{{'|'.join(CHECKS)}}} TARGET", file=sys.stderr)
        return 2
    kind, target = args
    problem = CHECKS[kind](target if kind == "http" else node_name(target))
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
