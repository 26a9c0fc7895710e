"""The schedule model: a seed -> timed faults and operator actions (the runner that plays
one is tests/chaos/runner.py).

A seed drives one ``random.Random``: it picks the store (local folder or S3 through the proxy)
and a list of steps, each at a time after the job started. Lasting faults come as two steps
(freeze/thaw, block/unblock, store down/up); a pause is usually followed by a resume; cancel
hits only the side job. The steps are data, so a failing schedule prints them and its seed
replays the same schedule (the interleaving with the fleet's own timing is not replayed).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.chaos import faults

MAIN, SIDE = "main", "side"
# A prompt longer than the engine's context: rejected, stored as a failed row (for
# requeue-failed and the failed counters).
TOO_LONG = "x" * 40000


@dataclass(frozen=True)
class Shape:
    """Size and timing of a schedule (kept small enough for a 2-core CI machine)."""

    gpus: int = 2
    prompts: int = 240
    batch_size: int = 10
    side_prompts: int = 30
    sim_speed: float = 2.0
    mean_output_tokens: int = 400
    too_long: int = 2
    window_s: float = 20.0  # steps fall in [1, window_s] seconds after the job started
    min_steps: int = 4
    max_steps: int = 8
    lease_s: int = 4  # FLEET_VISIBILITY_TIMEOUT_S
    settle_s: float = 6.0
    done_timeout_s: float = 180.0
    # No counter of a job moved for this long after the remedy: the job is stuck. The engine
    # wait (FLEET_ENGINE_WAIT_S) plus the lease plus margin.
    stall_s: float = 45.0
    manifest_wait_s: float = 30.0
    # Requests in flight per batch (FLEET_CLIENT_CONCURRENCY); None: the engine's cap derives it.
    client_concurrency: int | None = None

    def n_batches(self) -> dict[str, int]:
        """Batches of each job."""
        return {MAIN: -(-(self.prompts + self.too_long) // self.batch_size),
                SIDE: -(-self.side_prompts // self.batch_size)}

    def worker_env(self) -> dict[str, str]:
        """Fleet settings of the workers: a short lease, quick engine and store retries."""
        return {
            "FLEET_VISIBILITY_TIMEOUT_S": str(self.lease_s), "FLEET_LEASE_RENEW_S": "1",
            "FLEET_SWEEP_INTERVAL_S": "1", "FLEET_ENGINE_WAIT_S": "15",
            "FLEET_RECONCILE_INTERVAL_S": "5",
            "FLEET_ENGINE_STOP_GRACE_S": "2", "FLEET_ENGINE_START_TIMEOUT_S": "30",
            "FLEET_STORE_RETRY_MAX_S": "2", "FLEET_STORE_RETRY_ATTEMPTS": "30",
            "FLEET_RETRY_BASE_S": "0.2", "FLEET_RETRY_MAX_S": "2",
            "FLEET_SIM_SPEED": str(self.sim_speed),
            "FLEET_SIM_MEAN_OUTPUT_TOKENS": str(self.mean_output_tokens),
            "FLEET_METRICS_ENABLED": "false",
        } | ({"FLEET_CLIENT_CONCURRENCY": str(self.client_concurrency)}
             if self.client_concurrency else {})


# Few large batches sent a few rows at a time: when the queue runs dry, batches still hold
# unsent rows, so idle GPUs split them (workers/split/) while the faults and the
# operator's actions go on. Every third seed of ``make_schedule`` draws this shape.
# Three batches of unequal rows on two GPUs (main: 2 x 60 with the too-long rows, side: 24
# prompts x 3 samples = 72), sent 3 at a time, so whichever GPU sends its last batch first
# finds the other's with tens of rows unsent. No batch is a small remainder: with 120 + 2 rows
# in batches of 40 the fourth held 2 rows, and a pause that pulled it left nothing worth
# splitting (CI, stop 40: 0 parts). Faults can still leave no split: under CI's load a worker
# killed with most of the last batch answered left 12 rows, sent before the idle GPU's ask was
# granted (stop 41, 6 at a time), so tests/test_schedule.py tries a second splitting seed.
SPLITTING = Shape(prompts=118, batch_size=60, side_prompts=24, client_concurrency=3,
                  window_s=12.0)


def shape_for(seed: int) -> Shape:
    """The shape a seed draws when none is given."""
    return SPLITTING if seed % 3 == 2 else Shape()


@dataclass(frozen=True)
class Step:
    """One timed fault or operator action."""

    at_s: float
    kind: str
    args: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        args = " ".join(f"{k}={v}" for k, v in self.args.items())
        return f"t+{self.at_s:5.1f}s {self.kind} {args}".rstrip()

    @property
    def is_fault(self) -> bool:
        """Whether this step is a fault (else an operator action)."""
        return self.kind in faults.FAULTS


@dataclass
class Schedule:
    """A seed's schedule."""

    seed: int
    store: str  # "local" or "s3"
    shape: Shape
    steps: list[Step]

    def describe(self) -> str:
        """The schedule as lines a person can read."""
        head = (f"schedule seed={self.seed} store={self.store} gpus={self.shape.gpus} "
                f"batches of {self.shape.batch_size}"
                + (f", {self.shape.client_concurrency} in flight per batch"
                   if self.shape.client_concurrency else ""))
        return "\n".join([head, *(f"  {s}" for s in self.steps)])


# --- the model ---------------------------------------------------------------------------
Maker = Callable[[random.Random, float, "_Draft"], None]


@dataclass
class _Draft:
    """A schedule being drawn: its steps and what the constraints need to remember."""

    shape: Shape
    store: str
    steps: list[Step] = field(default_factory=list)
    blocked_for_good: int = 0
    cancelled: bool = False

    def add(self, at_s: float, kind: str, **args: Any) -> None:
        self.steps.append(Step(round(at_s, 1), kind, args))

    def gpu(self, rng: random.Random) -> int:
        return rng.randrange(self.shape.gpus)


def _kill_worker(rng: random.Random, t: float, d: _Draft) -> None:
    d.add(t, "kill_worker", gpu=d.gpu(rng))


def _kill_pool_child(rng: random.Random, t: float, d: _Draft) -> None:
    d.add(t, "kill_pool_child", gpu=d.gpu(rng), pick=rng.randrange(4))


def _kill_engine(rng: random.Random, t: float, d: _Draft) -> None:
    d.add(t, "kill_engine", gpu=d.gpu(rng), target=rng.choice(["engine", "engine", "guard"]))


def _freeze(rng: random.Random, t: float, d: _Draft) -> None:
    gpu = d.gpu(rng)
    d.add(t, "freeze_worker", gpu=gpu, with_engine=rng.random() < 0.5)
    d.add(t + d.shape.lease_s + rng.uniform(3, 9), "thaw_worker", gpu=gpu)


def _block_engine(rng: random.Random, t: float, d: _Draft) -> None:
    gpu = d.gpu(rng)
    d.add(t, "block_engine", gpu=gpu)
    if d.blocked_for_good < d.shape.gpus - 1 and rng.random() < 0.3:
        d.blocked_for_good += 1  # never unblocked: the job must finish on the other GPUs
    else:
        d.add(t + rng.uniform(3, 15), "unblock_engine", gpu=gpu)


def _restart_redis(rng: random.Random, t: float, d: _Draft) -> None:
    d.add(t, "restart_redis", hard=rng.random() < 0.5)


def _lose_queues(rng: random.Random, t: float, d: _Draft) -> None:
    d.add(t, "lose_queues")


def _store_down(rng: random.Random, t: float, d: _Draft) -> None:
    if d.store != "s3":
        return _kill_engine(rng, t, d)
    d.add(t, "store_down")
    d.add(t + rng.uniform(2, 8), "store_up")
    return None


def _pause(rng: random.Random, t: float, d: _Draft) -> None:
    d.add(t, "pause", job=MAIN)
    if rng.random() < 0.75:  # else the remedy resumes it
        d.add(t + rng.uniform(1, 6), "resume", job=MAIN)


def _cancel(rng: random.Random, t: float, d: _Draft) -> None:
    if d.cancelled:
        return _pause(rng, t, d)
    d.cancelled = True
    d.add(t, "cancel", job=SIDE)
    return None


def _job_action(kind: str) -> Maker:
    def make(rng: random.Random, t: float, d: _Draft) -> None:
        d.add(t, kind, job=MAIN)
    return make


def _enqueue_interrupted(rng: random.Random, t: float, d: _Draft) -> None:
    d.add(t, "enqueue_interrupted", job=MAIN, after_s=round(rng.uniform(0.3, 2.5), 2))


def _delete_result(rng: random.Random, t: float, d: _Draft) -> None:
    d.add(t, "delete_result", job=rng.choice([MAIN, MAIN, SIDE]), pick=rng.randrange(100))


# kind -> (weight, maker)
CATALOGUE: dict[str, tuple[float, Maker]] = {
    "kill_worker": (3, _kill_worker),
    "kill_pool_child": (3, _kill_pool_child),
    "kill_engine": (3, _kill_engine),
    "freeze_worker": (2, _freeze),
    "block_engine": (2, _block_engine),
    "restart_redis": (2, _restart_redis),
    "lose_queues": (1.5, _lose_queues),
    "store_down": (2, _store_down),
    "pause": (2, _pause),
    "cancel": (0.5, _cancel),
    "enqueue": (2, _job_action("enqueue")),
    "enqueue_interrupted": (1, _enqueue_interrupted),
    "requeue_failed": (1, _job_action("requeue_failed")),
    "sink": (1, _job_action("sink")),
    "delete_result": (1.5, _delete_result),
}


def make_schedule(seed: int, shape: Shape | None = None) -> Schedule:
    """The schedule of ``seed`` (pure: the same seed gives the same schedule)."""
    shape = shape or shape_for(seed)
    rng = random.Random(seed)
    draft = _Draft(shape=shape, store=rng.choice(["local", "s3"]))
    kinds = list(CATALOGUE)
    weights = [CATALOGUE[k][0] for k in kinds]
    for _ in range(rng.randint(shape.min_steps, shape.max_steps)):
        kind = rng.choices(kinds, weights)[0]
        CATALOGUE[kind][1](rng, rng.uniform(1.0, shape.window_s), draft)
    steps = sorted(draft.steps, key=lambda s: s.at_s)
    return Schedule(seed=seed, store=draft.store, shape=shape, steps=steps)
