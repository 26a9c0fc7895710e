"""Every Redis key name of the fleet (``{j}`` = job name, ``{b}`` = batch, ``{p}`` = part)::

    fleet:jobs                    set of job names
    fleet:job:{j}                 hash: spec (JSON), state, store_url, profile and needs (the
                                  launch profile FLEET_PROFILE named at enqueue and its output
                                  flags), started_at (enqueue), first_taken_at (first batch
                                  taken), last_row_at (last row recorded), parts_granted and
                                  rows_split (the job-end split)
    fleet:job:{j}:owner:{b}       the fencing token of the run that owns batch b (expires)
    fleet:job:{j}:prog:{b}        hash unit key -> the progress chunk holding its row
    fleet:job:{j}:done            set of batches whose results were stored (a cache of the store)
    fleet:job:{j}:stats           hash: completed, failed, quarantined (disjoint), truncated,
                                  output_tokens
    fleet:job:{j}:bstats          hash "b|field" -> what batch b adds to stats
    fleet:job:{j}:child_deaths    hash batch -> pool processes that died running it
    fleet:job:{j}:crashes         hash prompt index -> engine crashes while it was in flight
    fleet:job:{j}:series:n|:tok   hash 10-s bucket (and bucket|node) -> rows / output tokens
    fleet:job:{j}:stalled         hash node -> why it cannot work on the job now (status)
    fleet:job:{j}:sink            hash: the state of the job's latest sink run; :sink:auto the
                                  automatic trigger's mark, :sink:lock the data set's lock
    fleet:job:{j}:quality         hash: the live quality tally; :quality:ex:{figure} examples
    fleet:job:{j}:split:{b}       an idle GPU's open request for batch b's unsent rows; then
    fleet:job:{j}:part:{b}:{p}    the claim on part p of batch b (expires), :partrows:{b}:{p}
                                  its unit keys, :parts:{b} the part ids (workers/split/)
    fleet:node:{node}             hash: rows, output_tokens, crash_restarts over the worker's
                                  life; :prompts its rows by kind, :batch_seconds a histogram
    fleet:node:{node}:in_flight   hash batch -> its claim on the GPU (workers/delivery/gpu_share.py)
    fleet:node:{node}:handback    set while the worker shuts down: its batches hand back
    fleet:worker:{node}           the worker's heartbeat (JSON, expires)
    fleet:gpu-owner:{host}:{gpu}  the node name of the worker that owns the GPU (expires)
    fleet:janitor                 the lock of the janitor's round (expires)

Celery's own keys (the queue lists, kombu's ``unacked`` hash and ``unacked_index``) are
kombu's; workers/delivery/lease.py names them from the broker's options.
"""

from __future__ import annotations

import time

PREFIX = "fleet"
JOBS_KEY = f"{PREFIX}:jobs"
JANITOR_LOCK_KEY = f"{PREFIX}:janitor"
HEARTBEAT_PREFIX = f"{PREFIX}:worker:"
GPU_OWNER_PREFIX = f"{PREFIX}:gpu-owner:"
SERIES_BUCKET_S = 10  # the width of a field of the job's series hashes


def bucket(now: float | None = None) -> int:
    """The series field (a bucket's start, unix s) a moment falls in."""
    return int((now if now is not None else time.time()) // SERIES_BUCKET_S) * SERIES_BUCKET_S


class JobKeys:
    """Redis key names of one job (see the module docstring)."""

    def __init__(self, job: str) -> None:
        base = f"{PREFIX}:job:{job}"
        self.job = base  # the job's hash, and the prefix of its other keys
        self.done = f"{base}:done"
        self.stats = f"{base}:stats"
        self.bstats = f"{base}:bstats"
        self.child_deaths = f"{base}:child_deaths"
        self.crashes = f"{base}:crashes"
        self.series_n = f"{base}:series:n"
        self.series_tok = f"{base}:series:tok"
        self.sink = f"{base}:sink"
        self.sink_auto = f"{base}:sink:auto"
        self.sink_lock = f"{base}:sink:lock"
        self.stalled = f"{base}:stalled"
        self.quality = f"{base}:quality"
        self._base = base

    def __repr__(self) -> str:
        return f"<JobKeys {self._base}>"

    def progress(self, batch: int) -> str:
        """The progress hash of one batch."""
        return f"{self._base}:prog:{batch}"

    def owner(self, batch: int) -> str:
        """The batch's ownership token (workers/delivery/ownership.py)."""
        return f"{self._base}:owner:{batch}"

    def owner_prefix(self) -> str:
        """What every owner key of the job starts with (a scan's pattern before its ``*``)."""
        return f"{self._base}:owner:"

    def quality_examples(self, figure: str) -> str:
        """The list of example row ids of one live quality figure."""
        return f"{self.quality}:ex:{figure}"

    def split_request(self, batch: int) -> str:
        """The batch's open split request."""
        return f"{self._base}:split:{batch}"

    def part(self, batch: int, part: str) -> str:
        """A part's claim: its asker's token while the part is live."""
        return f"{self._base}:part:{batch}:{part}"

    def part_rows(self, batch: int, part: str) -> str:
        """The unit keys a part holds."""
        return f"{self._base}:partrows:{batch}:{part}"

    def parts(self, batch: int) -> str:
        """The ids of the batch's parts."""
        return f"{self._base}:parts:{batch}"

    def scratch(self, n: int) -> str:
        """A throwaway key (``--reuse-from`` records rows without the worker's series)."""
        return f"{self._base}:reuse:scratch:{n}"


class NodeKeys:
    """Redis key names of one worker (``node``: its Celery node name)."""

    def __init__(self, node: str) -> None:
        self.stats = f"{PREFIX}:node:{node}"  # lifetime counters
        self.prompts = f"{self.stats}:prompts"  # finished prompts by kind
        self.batch_seconds = f"{self.stats}:batch_seconds"  # batch-duration histogram
        self.in_flight = f"{self.stats}:in_flight"  # requests in flight, a field per batch
        self.handback = f"{self.stats}:handback"  # set while it shuts down
        self.heartbeat = f"{HEARTBEAT_PREFIX}{node}"

    def __repr__(self) -> str:
        return f"<NodeKeys {self.stats}>"


def gpu_owner_key(host: str, gpu: int) -> str:
    """The node name of GPU ``gpu``'s owner on ``host``."""
    return f"{GPU_OWNER_PREFIX}{host}:{gpu}"
