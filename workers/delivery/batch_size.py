"""The batch size of a job enqueued without ``--batch-size``: sized for the fleet that is up.

- At least 4 × the largest live GPU's in-flight budget (the runbook's bound: a smaller batch is
  mostly tail).
- Otherwise ``FLEET_BATCH_SIZE`` (500, the runbook's minutes-per-batch size). Finer batches
  for a mid-sized job were tried (8 per GPU, not under 4 × the budget): on the simulator,
  3,000 prompts on 2 GPUs, batches of 324 ended the job less evenly than batches of 500
  (whole-job occupancy 0.89-0.90 against 0.95; bench/README.md), so they are not used.
- Small enough that every live GPU gets at least 2 batches: a job of 200 prompts on 2 GPUs is
  4 batches of 50, not one of 500 that leaves the second GPU idle. Where the two bounds meet
  (a small job), spreading wins: the elastic hold (workers/delivery/hold.py) takes the next
  batch as soon as a small one is fully sent, so a batch under 4 × the budget still keeps the
  engine full, while a GPU without a batch does nothing.
- No live worker (nothing to size for): ``FLEET_BATCH_SIZE``.

Only the first ``2 × GPUs × size`` rows need to be seen to know: :func:`choose` reads that many
ahead and hands every row on, so a job of any size is still streamed once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import redis

from config.settings import Settings
from workers.node.heartbeat import read_heartbeats

BUDGET_FACTOR = 4  # batch >= this x the in-flight budget
MIN_BATCHES_PER_GPU = 2


def in_flight_budget(beat: dict[str, Any], settings: Settings) -> int:
    """Requests a worker keeps in flight (as its batches compute it, workers/batch/runner.py):
    the fixed setting or profile's, else the engine's cap × headroom + 1."""
    fixed = settings.client_concurrency or beat.get("client_concurrency")
    if fixed:
        return int(fixed)
    return math.ceil(int(beat.get("cap") or 64) * settings.client_headroom) + 1


def live_budgets(r: redis.Redis, settings: Settings) -> list[int]:
    """One in-flight budget per live GPU worker (a heartbeat with an engine)."""
    return [in_flight_budget(b, settings) for b in read_heartbeats(r) if b.get("engine")]


def size_for(total: int | None, budgets: list[int], default: int) -> int:
    """The rule above; ``total`` None: the job is larger than any bound needs."""
    if not budgets:
        return default
    size = max(default, BUDGET_FACTOR * max(budgets))
    if total is not None:
        size = min(size, math.ceil(total / (MIN_BATCHES_PER_GPU * len(budgets))))
    return max(size, 1)


def choose(rows: Iterable[dict[str, Any]], budgets: list[int], default: int
           ) -> tuple[int, Iterator[dict[str, Any]]]:
    """The job's batch size and its rows, every one of them (the first few read ahead)."""
    it = iter(rows)
    if not budgets:
        return default, it
    largest = size_for(None, budgets, default)
    need = largest * MIN_BATCHES_PER_GPU * len(budgets)
    ahead = list(itertools.islice(it, need))
    total = len(ahead) if len(ahead) < need else None
    return size_for(total, budgets, default), itertools.chain(ahead, it)


def chooser(r: redis.Redis, settings: Settings
            ) -> Callable[[Iterable[dict[str, Any]]], tuple[int, Iterator[dict[str, Any]]]]:
    """:func:`choose` for the fleet that is up now (``enqueue``'s ``choose_size``); the
    heartbeats are read only when a new job needs a size. Redis unreachable: the default."""
    def pick(rows: Iterable[dict[str, Any]]) -> tuple[int, Iterator[dict[str, Any]]]:
        try:
            budgets = live_budgets(r, settings)
        except redis.RedisError:
            budgets = []
        return choose(rows, budgets, settings.batch_size)
    return pick
