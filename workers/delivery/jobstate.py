"""Live job state in Redis: pending/running/done batches, progress inside a batch, counters.

Redis holds only what can be rebuilt: the store has the job record, the staged inputs and the
results. Counters are bumped in the same Lua call that records a row, only the first time a row
is recorded and only from the batch's current owner, so a redelivered batch never counts a
prompt twice. There is no "pending" mark: where a batch is (queued, held, done) is derived
from the broker and the owner keys when it matters (workers/delivery/whereabouts.py).

Keys (``{j}`` = job name)::

    fleet:jobs                    set of job names
    fleet:job:{j}                 hash: spec (JSON), state, store_url, profile and needs (the
                                  launch profile FLEET_PROFILE named at enqueue and its output
                                  flags), started_at (enqueue),
                                  first_taken_at (first batch taken), last_row_at (last row
                                  recorded)
    fleet:job:{j}:owner:{b}       the fencing token of the run that owns batch b (expires)
    fleet:job:{j}:split:{b}       an idle GPU's open request for batch b's unsent rows; then
    fleet:job:{j}:part:{b}:{p}    the claim on part p of batch b (expires), :partrows:{b}:{p}
                                  its unit keys, :parts:{b} the part ids
                                  (workers/delivery/split.py)
    fleet:job:{j}:done            set of batches whose results were stored (a cache of the store)
    fleet:job:{j}:stats           hash: completed, failed, quarantined (disjoint), truncated,
                                  output_tokens
    fleet:job:{j}:bstats          hash "b|field" -> what batch b adds to stats
    fleet:job:{j}:child_deaths    hash batch -> pool processes that died running it
    fleet:job:{j}:prog:{b}        hash row index -> result row (JSON), progress of batch b
    fleet:job:{j}:series:n|:tok   hash 10-s bucket (and bucket|node) -> rows / output tokens
    fleet:job:{j}:stalled         hash node -> why it cannot work on the job now (status)
    fleet:node:{node}             hash: rows, output_tokens over the worker's life (all jobs)
    fleet:node:{node}:in_flight   hash batch -> its claim on the GPU (workers/delivery/gpu_share.py)
    fleet:node:{node}:handback    set while the worker shuts down: its batches hand back
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import redis

from workers.dataset.jobs import redis_job_key

SERIES_BUCKET_S = 10

# Per-batch counters ("{batch}|{field}" in the job's bstats hash) mirror what each batch adds to
# the job's stats, so a batch's contribution can be replaced exactly (SET_BATCH_COUNTS) when the
# store says otherwise: the counters stay equal to what the store holds plus the open batches.
COUNT_FIELDS = ("completed", "failed", "quarantined", "truncated", "output_tokens")
# The job hash's fields split.GRANT counts: parts granted at the job's end, and their rows.
SPLIT_FIELDS = ("parts_granted", "rows_split")

_BUMP = """
local function bump(field, n)
  redis.call('HINCRBY', KEYS[2], field, n)
  redis.call('HINCRBY', KEYS[8], ARGV[1] .. '|' .. field, n)
end
"""

# Records rows of a batch, only from the batch's current owner (its fencing token): -1 when
# the caller no longer owns the batch. Each row is counted the first time it is recorded, and
# the job's hash (KEYS[9], when given) keeps the latest time a row was counted (ARGV[5]).
RECORD_ROWS = _BUMP + """
if redis.call('GET', KEYS[7]) ~= ARGV[4] then return -1 end
local is_done = redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1
local counted = 0
for i = 6, #ARGV, 4 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 and not is_done then
    counted = counted + 1
    local kind = ARGV[i + 2]
    local tok = tonumber(ARGV[i + 3])
    if kind == 'failed' or kind == 'quarantined' then
      bump(kind, 1)
    else
      bump('completed', 1)
      if kind == 'truncated' then bump('truncated', 1) end
    end
    bump('output_tokens', tok)
    redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
    redis.call('HINCRBY', KEYS[4], ARGV[2] .. '|' .. ARGV[3], 1)
    redis.call('HINCRBY', KEYS[5], ARGV[2], tok)
    redis.call('HINCRBY', KEYS[5], ARGV[2] .. '|' .. ARGV[3], tok)
    redis.call('HINCRBY', KEYS[6], 'rows', 1)
    redis.call('HINCRBY', KEYS[6], 'output_tokens', tok)
  end
end
if counted > 0 and KEYS[9] then
  local last = tonumber(redis.call('HGET', KEYS[9], 'last_row_at') or '0')
  if tonumber(ARGV[5]) > last then redis.call('HSET', KEYS[9], 'last_row_at', ARGV[5]) end
end
return counted
"""

# The owner's last step, after its results are in the store: 0 if it no longer owns the batch.
# KEYS: done, progress, owner; ARGV: batch, token.
FINISH_BATCH = """
if redis.call('GET', KEYS[3]) ~= ARGV[2] then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
redis.call('DEL', KEYS[3])
return 1
"""

# Replace a batch's contribution to the job's counters by ARGV's (field, value) pairs.
SET_BATCH_COUNTS = """
for i = 2, #ARGV, 2 do
  local f = ARGV[1] .. '|' .. ARGV[i]
  local new = tonumber(ARGV[i + 1])
  local old = tonumber(redis.call('HGET', KEYS[2], f) or '0')
  if new ~= old then redis.call('HINCRBY', KEYS[1], ARGV[i], new - old) end
  if new == 0 then redis.call('HDEL', KEYS[2], f) else redis.call('HSET', KEYS[2], f, new) end
end
return 1
"""

class Keys:
    """Redis key names of one job."""

    def __init__(self, job: str) -> None:
        base = redis_job_key(job)
        self.job = base
        self.done = f"{base}:done"
        self.stats = f"{base}:stats"
        self.bstats = f"{base}:bstats"
        self.child_deaths = f"{base}:child_deaths"
        self.series_n = f"{base}:series:n"
        self.series_tok = f"{base}:series:tok"
        # The state of the job's latest sink run (workers/wiring/sink_task.py).
        self.sink = f"{base}:sink"
        # Workers that could not read the job's store lately: node -> JSON {why, at}.
        self.stalled = f"{base}:stalled"
        # The live quality tally of a running job (workers/delivery/quality_live.py), and the
        # examples of each figure (``{quality}:ex:<figure>``, a list of row ids).
        self.quality = f"{base}:quality"
        self._base = base

    def progress(self, batch: int) -> str:
        """Key of the progress hash of one batch."""
        return f"{self._base}:prog:{batch}"

    def owner(self, batch: int) -> str:
        """Key of the batch's ownership token (workers/delivery/ownership.py)."""
        return f"{self._base}:owner:{batch}"


JOBS_KEY = "fleet:jobs"


def handback_key(node: str) -> str:
    """Set by a worker that is shutting down: its batches hand themselves back."""
    return f"fleet:node:{node}:handback"

# How long a worker's "cannot read the job" note stands without being renewed.
STALL_NOTE_S = 90.0


def note_stalled(r: redis.Redis, job: str, node: str, why: str) -> None:
    """Record that ``node`` cannot work on ``job`` (``why``: one line for ``status``)."""
    key = Keys(job).stalled
    pipe = r.pipeline()
    pipe.hset(key, node, orjson.dumps({"why": why, "at": round(time.time(), 3)}))
    pipe.expire(key, int(STALL_NOTE_S))
    pipe.execute()


def record_profile(r: redis.Redis, job: str, profile: str,
                   needs: dict[str, str | None]) -> None:
    """The launch profile a job was enqueued for and the output flags it needs an engine to
    run with (config/launch_profile.py OUTPUT_FLAGS); workers with other values refuse it."""
    r.hset(Keys(job).job, mapping={"profile": profile, "needs": orjson.dumps(needs)})


def clear_stalled(r: redis.Redis, job: str, node: str) -> None:
    """``node`` can read the job again."""
    r.hdel(Keys(job).stalled, node)


def stalled_notes(r: redis.Redis, job: str) -> list[str]:
    """``node why`` for every worker that noted, within STALL_NOTE_S, that it cannot work on
    ``job``."""
    now, out = time.time(), []
    for node, raw in sorted(r.hgetall(Keys(job).stalled).items()):
        note = orjson.loads(raw)
        if now - float(note.get("at", 0)) <= STALL_NOTE_S:
            out.append(f"{node.decode()} {note.get('why', '')}")
    return out


def bucket(now: float | None = None) -> int:
    """The time-series bucket a moment falls in."""
    return int((now if now is not None else time.time()) // SERIES_BUCKET_S) * SERIES_BUCKET_S


def record_keys(job: str, batch: int, node_key: str, fence: str | None = None) -> list[str]:
    """KEYS for RECORD_ROWS, ``node_key`` the worker's lifetime counters; the writer's token
    must be held by ``fence``: the batch's owner key, or a part's (workers/delivery/split.py)."""
    k = Keys(job)
    return [k.progress(batch), k.stats, k.done, k.series_n, k.series_tok, node_key,
            fence or k.owner(batch), k.bstats, k.job]


def record_args(batch: int, node: str, token: str,
                rows: list[tuple[int | str, bytes, str, int]]) -> list[Any]:
    """ARGV for RECORD_ROWS: batch, bucket, node, owner token, now, then (unit key: the
    index, or "index:sample" for samples after the first; row, kind,
    tokens) per row."""
    now = time.time()
    argv: list[Any] = [batch, bucket(now), node, token, round(now, 3)]
    for index, row, kind, tokens in rows:
        argv += [index, row, kind, tokens]
    return argv


def register_job(r: redis.Redis, job: str, spec_json: str, store_url: str | None = None
                 ) -> None:
    """Record the job in Redis as running (idempotent; keeps the first start time), and where
    its store is (``store_url``), so every command finds it from any directory."""
    keys = Keys(job)
    pipe = r.pipeline()
    pipe.sadd(JOBS_KEY, job)
    fields = {"spec": spec_json, "state": "running"}
    if store_url:
        fields["store_url"] = store_url
    pipe.hset(keys.job, mapping=fields)
    pipe.hsetnx(keys.job, "started_at", time.time())
    pipe.execute()


def batch_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """What stored rows add to the job's counters (failed and quarantined are disjoint, as in
    ``verify`` and the manifest)."""
    from workers.dataset.manifest import (
        row_bucket,  # pyarrow: kept off the status command's imports
    )

    out = dict.fromkeys(COUNT_FIELDS, 0)
    for row in rows:
        kind = row_bucket(row)
        if kind in ("failed", "quarantined"):
            out[kind] += 1
        else:
            out["completed"] += 1
            out["truncated"] += kind == "truncated"
        out["output_tokens"] += int(row.get("completion_tokens") or 0)
    return out


def set_batch_counts(r: redis.Redis | redis.client.Pipeline, job: str, batch: int,
                     counts: dict[str, int]) -> None:
    """Make ``batch``'s contribution to the job's counters exactly ``counts``."""
    keys = Keys(job)
    args: list[Any] = [batch]
    for field in COUNT_FIELDS:
        args += [field, int(counts.get(field, 0))]
    r.eval(SET_BATCH_COUNTS, 2, keys.stats, keys.bstats, *args)


def counters(r: redis.Redis, job: str) -> dict[str, int]:
    """The job's live counters as integers (missing ones are 0)."""
    raw = r.hgetall(Keys(job).stats)
    return {n: int(raw.get(n.encode(), 0)) for n in COUNT_FIELDS}


def node_stats_key(node: str) -> str:
    """Key of a worker's lifetime counters."""
    return f"fleet:node:{node}"


def node_prompts_key(node: str) -> str:
    """Redis hash of a worker's finished prompts by kind."""
    return f"{node_stats_key(node)}:prompts"


def in_flight_key(node: str) -> str:
    """Hash of a worker's requests in flight, one field per running batch."""
    return f"fleet:node:{node}:in_flight"
