"""The batch size of a job given none (workers/delivery/batch_size.py)."""

from __future__ import annotations

from config.settings import Settings
from tests.conftest import run_producer, wait_done, write_prompts
from workers.delivery.batch_size import choose, in_flight_budget, size_for


def test_at_least_four_budgets_and_two_batches_per_live_gpu():
    assert size_for(100_000, [], 500) == 500  # no live worker: the setting
    assert size_for(100_000, [51, 51], 500) == 500  # a large job: the setting
    assert size_for(100_000, [251], 500) == 1004  # 4 x a large budget
    assert size_for(200, [51, 51], 500) == 50  # the README's example: 4 batches
    assert size_for(3000, [51, 51], 500) == 500
    assert size_for(1500, [51, 51], 500) == 375
    assert size_for(3, [51] * 7, 500) == 1


def test_choose_reads_only_what_it_needs_and_hands_every_row_on():
    taken = []

    def rows(n):
        for i in range(n):
            taken.append(i)
            yield {"i": i}

    size, it = choose(rows(10**6), [51, 51], 500)
    assert size == 500 and len(taken) == 2000  # 2 batches x 2 GPUs read ahead, no more
    assert sum(1 for _ in it) == 10**6
    size, it = choose(rows(200), [51, 51], 500)
    assert size == 50 and [r["i"] for r in it] == list(range(200))


def test_budget_follows_the_workers_own_rule():
    s = Settings()
    assert in_flight_budget({"cap": 40}, s) == 51  # cap 40 x 1.25 + 1
    assert in_flight_budget({"cap": 40, "client_concurrency": 8}, s) == 8
    assert in_flight_budget({}, s) == 81


def test_a_small_job_is_spread_over_every_live_gpu(fleet_env, make_workers, tmp_path, r):
    make_workers([0, 1])
    prompts = write_prompts(tmp_path / "prompts.jsonl", 200)
    res = run_producer(fleet_env, "enqueue", str(prompts), "--job", "small")
    assert res.returncode == 0, res.stderr
    assert "200 prompts in 4 batches of 50" in res.stderr
    st = wait_done(fleet_env, "small")
    assert st["completed"] == 200
    # Resuming keeps the job's size whatever the fleet looks like now.
    again = run_producer(fleet_env, "enqueue", str(prompts), "--job", "small")
    assert again.returncode == 0 and "4 batches of 50" in again.stderr, again.stderr
