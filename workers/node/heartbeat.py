"""Worker heartbeats: one JSON key per worker with a TTL, so a dead worker simply vanishes."""

from __future__ import annotations

from typing import Any

import orjson
import redis

from workers.redisdb.keys import HEARTBEAT_PREFIX, NodeKeys


def publish(r: redis.Redis, node: str, payload: dict[str, Any], ttl_s: float) -> None:
    """Write a heartbeat that expires after ``ttl_s`` seconds."""
    r.set(NodeKeys(node).heartbeat, orjson.dumps(payload), px=int(ttl_s * 1000))


def read_heartbeats(r: redis.Redis) -> list[dict[str, Any]]:
    """Every live worker's heartbeat, sorted by node name."""
    keys = sorted(r.scan_iter(match=f"{HEARTBEAT_PREFIX}*", count=500))
    values = r.mget(keys) if keys else []
    return [orjson.loads(v) for v in values if v]
