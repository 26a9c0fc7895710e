"""The benchmarks run end to end at a tiny size (figures are not asserted: they are not tests)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from bench.common import Goal, capped_mean_tokens
from bench.engines import EngineModel, parse_counter, planned_engine_model

ROOT = Path(__file__).resolve().parents[1]


def test_ideal_bound_is_the_simulators_model() -> None:
    # 40 running, accept length 3.5, step 20 + 0.5 * 40 ms: the workload's 3,500 tok/s per GPU.
    model = planned_engine_model("qwen36-27b", speed=2.0)
    assert model == EngineModel(cap=40, draft_tokens=4, speed=2.0)
    assert math.isclose(model.ideal_tokens_per_s, 7000.0)


def test_capped_mean_is_below_the_mean_and_the_cap() -> None:
    assert 2000 < capped_mean_tokens() < 2490
    assert math.isclose(capped_mean_tokens(cap=1e12), 2490, rel_tol=1e-6)


def test_counter_parsing_and_goal_direction() -> None:
    text = ('sglang:realtime_tokens_total{mode="decode",tp_rank="0"} 12.0\n'
            'sglang:realtime_tokens_total{mode="prefill_compute",tp_rank="0"} 5.0\n')
    assert parse_counter(text, "sglang:realtime_tokens_total", 'mode="decode"') == 12.0
    assert Goal("x", 0.5, 1.0, at_most=True).ok and not Goal("y", 0.5, 1.0).ok


def test_vs_plain_runs_end_to_end_at_a_tiny_size() -> None:
    # One GPU, 40 prompts, a fast engine: fleet job, then the plain client twice.
    res = subprocess.run(
        [sys.executable, "-m", "bench.vs_plain", "--gpus", "1", "--prompts", "40",
         "--batch-size", "20", "--speed", "200"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode in (0, 1), res.stdout + res.stderr  # 1 = a goal missed, not a crash
    assert "bench.vs_plain (goal 2)" in res.stdout
    assert "40 done, 0 failed" in res.stdout


def test_redis_peak_schedule_holds_a_batch_per_gpu_and_more_at_its_peak() -> None:
    from bench.redis_peak import BATCH, schedule

    events = schedule(gpus=2, batches_per_gpu=4)
    answers = [e for e in events if e.kind == "answer"]
    assert len(answers) == 2 * 4 * BATCH
    live = peak = 0
    for e in events:
        live += 1 if e.kind == "answer" else -BATCH
        peak = max(peak, live)
    assert live == 0 and 2 * BATCH < peak < 2 * 2 * BATCH


def test_redis_peak_and_s3_staging_run_end_to_end_at_a_tiny_size() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "bench.redis_peak", "--queued", "1000", "--gpus", "1",
         "--batches-per-gpu", "3", "--row-kb", "1", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode in (0, 1), res.stdout + res.stderr
    assert "bench.redis_peak (finding 1)" in res.stdout
    res = subprocess.run(
        [sys.executable, "-m", "bench.s3_staging", "--prompts", "2000"],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode in (0, 1), res.stdout + res.stderr
    assert "bench.s3_staging (finding 2)" in res.stdout and "enqueued 4" in res.stdout


def test_tail_model_schedules_every_prompt_once_and_stealing_never_loses() -> None:
    from bench.tail_model import CAP, STORE_S, cut, durations, fleet, plain

    assert sum(cut(2345, 100)) == sum(cut(2345, 100, taper_gpus=3)) == 2345
    assert max(cut(2345, 100, taper_gpus=3)[-5:]) < 100  # the tail is cut smaller
    # One batch that fits the engine: done when its longest request is, then stored.
    durs = durations(CAP, seed=1)
    assert fleet(durs, [CAP], gpus=1) == max(durs) + STORE_S
    durs = durations(2 * 20 * 100, seed=2)
    sizes = cut(len(durs), 100)
    lower = sum(durs) / (2 * CAP)  # every slot busy all the time
    end, occupancy = plain(durs, gpus=2)
    assert lower <= end and 0.9 < occupancy <= 1.0
    assert lower < fleet(durs, sizes, 2, steal=True) <= fleet(durs, sizes, 2)
