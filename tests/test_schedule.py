"""Randomized, seeded fault-and-operator schedules (issue 12): nothing lost, nothing doubled.

Each seed is one schedule of faults and operator actions against a real fleet (see
tests/chaos/). A failing schedule prints its steps and the command that replays it:
``FLEET_SCHEDULE_SEED=N .venv/bin/python -m pytest tests/test_schedule.py -k replay``.
``make test`` runs two short schedules (``SHORT``: fewer prompts and steps in a shorter
window); the full-size CI seeds and ``make soak`` (tests/chaos/soak.py) carry the marker
``soak`` and run only under ``make soak`` / ``pytest -m soak``.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.chaos.runner import run_schedule
from tests.chaos.schedule import SIDE, SPLITTING, Shape, make_schedule

# One schedule on the local store (a worker frozen past its lease, engines that cannot restart
# for a while, a SIGKILLed worker and pool child, Redis restarted, the sink and enqueue mid-job),
# one on S3 through the proxy (Redis restarted, pause/resume while a worker and its engine are
# frozen, an interrupted and a full enqueue, the store cut off).
CI_SEEDS = [160, 351]
# The short subset of `make test`: seed 8 on the local store (an engine blocked then freed, a
# result deleted, a SIGKILLed worker and pool child), seed 9 on S3 (an engine and a worker
# killed, the queues lost, Redis hard-restarted).
SHORT = Shape(prompts=80, side_prompts=20, window_s=8.0, min_steps=3, max_steps=4)
SHORT_SEEDS = [8, 9]
# Batches split at the job's end under faults (tests/chaos/schedule.py SPLITTING): the first
# seed, and the second only when the faults of the first left nothing to split.
SPLIT_SEEDS = [2, 5]
# Seeds that fail on the delivery code of today, with the finding of issue 12 that makes them
# fail; remove an entry once its fix lands (the schedule must then pass).
KNOWN_FAILING: dict[int, str] = {}


def _ci_seed(seed: int) -> object:
    if seed in KNOWN_FAILING:
        return pytest.param(seed, marks=pytest.mark.xfail(reason=KNOWN_FAILING[seed]))
    return seed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SHORT_SEEDS)
def test_short_schedule(seed, fleet_env, moto_server, tmp_path):
    out = run_schedule(make_schedule(seed, SHORT), fleet_env, tmp_path, moto_server)
    print(out.report())
    assert out.ok, out.report()


@pytest.mark.timeout(480)
def test_split_schedule(fleet_env, moto_server, tmp_path):
    # Every schedule run must keep its invariants; one of them at least must split a batch
    # (a seed's faults may leave the last batch nearly answered, with nothing to split).
    for seed in SPLIT_SEEDS:
        schedule = make_schedule(seed)
        assert schedule.shape == SPLITTING
        root = tmp_path / f"seed{seed}"
        root.mkdir()
        out = run_schedule(schedule, fleet_env, root, moto_server)
        print(out.report())
        assert out.ok, out.report()
        if out.splits >= 1:
            return
    raise AssertionError(f"no batch was split in seeds {SPLIT_SEEDS}: the schedules did not "
                         "test what they are for")


@pytest.mark.soak
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [_ci_seed(s) for s in CI_SEEDS])
def test_schedule(seed, fleet_env, moto_server, tmp_path):
    out = run_schedule(make_schedule(seed), fleet_env, tmp_path, moto_server)
    print(out.report())
    assert out.ok, out.report()


@pytest.mark.timeout(600)
def test_replay(fleet_env, moto_server, tmp_path):
    seed = os.environ.get("FLEET_SCHEDULE_SEED")
    if not seed:
        pytest.skip("set FLEET_SCHEDULE_SEED=N to replay the schedule of seed N")
    out = run_schedule(make_schedule(int(seed)), fleet_env, tmp_path, moto_server)
    print(out.report())
    assert out.ok, out.report()


def test_a_seed_always_draws_the_same_schedule_within_the_model():
    for seed in range(300):
        s = make_schedule(seed)
        assert s.describe() == make_schedule(seed).describe()
        kinds = [x.kind for x in s.steps]
        blocked = [x.args["gpu"] for x in s.steps if x.kind == "block_engine"]
        unblocked = [x.args["gpu"] for x in s.steps if x.kind == "unblock_engine"]
        assert len(blocked) - len(unblocked) < s.shape.gpus  # one GPU at least can work
        assert kinds.count("freeze_worker") == kinds.count("thaw_worker")
        assert all(x.args["job"] == SIDE for x in s.steps if x.kind == "cancel")
        assert s.store == "s3" or "store_down" not in kinds


SOAK_MINUTES = float(os.environ.get("FLEET_SOAK_MINUTES", "0"))


@pytest.mark.soak
@pytest.mark.timeout(int(SOAK_MINUTES * 60) + 900)
def test_soak(fleet_env, moto_server, tmp_path):
    if not SOAK_MINUTES:
        pytest.skip("make soak (python -m tests.chaos.soak) runs this")
    from tests.chaos.soak import summary

    first = int(os.environ.get("FLEET_SOAK_FIRST_SEED", "0"))
    start, outcomes = time.monotonic(), []
    while time.monotonic() - start < SOAK_MINUTES * 60:
        seed = first + len(outcomes)
        out = run_schedule(make_schedule(seed), fleet_env, tmp_path / f"seed{seed}",
                           moto_server)
        outcomes.append(out)
        print(f"seed {seed} ({out.schedule.store}, {out.faults} faults, {out.actions} actions, "
              f"{out.seconds:.0f} s): " + ("ok" if out.ok else "FAILED"), flush=True)
        if not out.ok:
            print(out.report(), flush=True)
    print(summary(outcomes, (time.monotonic() - start) / 60))
    failing = [o.schedule.seed for o in outcomes if not o.ok]
    assert not failing, f"failing seeds {failing} (see the summary above)"
