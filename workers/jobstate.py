"""Live job state in Redis: pending/running/done batches, progress inside a batch, counters.

Redis holds only what can be rebuilt: the store has the job record, the staged inputs and the
results. Counters are bumped in the same Lua call that records a row, and only the first time a
row is recorded, so a redelivered batch never counts a prompt twice.

Keys (``{j}`` = job name)::

    fleet:jobs                    set of job names
    fleet:job:{j}                 hash: spec (JSON), started_at
    fleet:job:{j}:pending         set of batches enqueued and not finished
    fleet:job:{j}:running         hash batch -> worker node
    fleet:job:{j}:done            set of finished batches
    fleet:job:{j}:stats           hash: completed, failed, truncated, output_tokens
    fleet:job:{j}:prog:{b}        hash row index -> result row (JSON), progress of batch b
    fleet:job:{j}:series:n|:tok   hash 10-s bucket (and bucket|node) -> rows / output tokens
    fleet:node:{node}             hash: rows, output_tokens over the worker's life (all jobs)
    fleet:node:{node}:in_flight   hash batch -> its claim on the GPU (workers/gpu_share.py)
"""

from __future__ import annotations

import time
from typing import Any

import redis

SERIES_BUCKET_S = 10

RECORD_ROWS = """
local is_done = redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1
local counted = 0
for i = 4, #ARGV, 4 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 and not is_done then
    counted = counted + 1
    local kind = ARGV[i + 2]
    local tok = tonumber(ARGV[i + 3])
    if kind == 'failed' then
      redis.call('HINCRBY', KEYS[2], 'failed', 1)
    else
      redis.call('HINCRBY', KEYS[2], 'completed', 1)
      if kind == 'truncated' then redis.call('HINCRBY', KEYS[2], 'truncated', 1) end
    end
    redis.call('HINCRBY', KEYS[2], 'output_tokens', tok)
    redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
    redis.call('HINCRBY', KEYS[4], ARGV[2] .. '|' .. ARGV[3], 1)
    redis.call('HINCRBY', KEYS[5], ARGV[2], tok)
    redis.call('HINCRBY', KEYS[5], ARGV[2] .. '|' .. ARGV[3], tok)
    redis.call('HINCRBY', KEYS[6], 'rows', 1)
    redis.call('HINCRBY', KEYS[6], 'output_tokens', tok)
  end
end
return counted
"""

FINISH_BATCH = """
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4])
return 1
"""


class Keys:
    """Redis key names of one job."""

    def __init__(self, job: str) -> None:
        base = f"fleet:job:{job}"
        self.job = base
        self.pending = f"{base}:pending"
        self.running = f"{base}:running"
        self.done = f"{base}:done"
        self.stats = f"{base}:stats"
        self.series_n = f"{base}:series:n"
        self.series_tok = f"{base}:series:tok"
        self._base = base

    def progress(self, batch: int) -> str:
        """Key of the progress hash of one batch."""
        return f"{self._base}:prog:{batch}"


JOBS_KEY = "fleet:jobs"


def bucket(now: float | None = None) -> int:
    """The time-series bucket a moment falls in."""
    return int((now if now is not None else time.time()) // SERIES_BUCKET_S) * SERIES_BUCKET_S


def record_args(batch: int, node: str, rows: list[tuple[int, bytes, str, int]]) -> list[Any]:
    """ARGV for RECORD_ROWS: batch, bucket, node, then (index, row, kind, tokens) per row."""
    argv: list[Any] = [batch, bucket(), node]
    for index, row, kind, tokens in rows:
        argv += [index, row, kind, tokens]
    return argv


def register_job(r: redis.Redis, job: str, spec_json: str) -> None:
    """Record the job in Redis as running (idempotent; keeps the first start time)."""
    keys = Keys(job)
    pipe = r.pipeline()
    pipe.sadd(JOBS_KEY, job)
    pipe.hset(keys.job, mapping={"spec": spec_json, "state": "running"})
    pipe.hsetnx(keys.job, "started_at", time.time())
    pipe.execute()


def counters(r: redis.Redis, job: str) -> dict[str, int]:
    """The job's live counters as integers (missing ones are 0)."""
    raw = r.hgetall(Keys(job).stats)
    names = ("completed", "failed", "truncated", "output_tokens")
    return {n: int(raw.get(n.encode(), 0)) for n in names}


def node_stats_key(node: str) -> str:
    """Key of a worker's lifetime counters."""
    return f"fleet:node:{node}"


def in_flight_key(node: str) -> str:
    """Hash of a worker's requests in flight, one field per running batch."""
    return f"fleet:node:{node}:in_flight"
