"""The benchmarks run end to end at a tiny size (figures are not asserted: they are not tests)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_elastic_hold_bench_runs_end_to_end_at_a_tiny_size() -> None:
    # One GPU, 60 prompts, a fast engine: the fleet's own batch size, then the plain client.
    res = subprocess.run(
        [sys.executable, "-m", "bench.elastic_hold", "--gpus", "1", "--prompts", "60",
         "--speed", "200"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode in (0, 1), res.stdout + res.stderr  # 1 = a goal missed, not a crash
    assert "bench.elastic_hold (issue 37)" in res.stdout
    assert "the fleet's batch size for 60 prompts on 1 GPUs: 30" in res.stdout
    assert "60 done" in res.stdout


def test_idle_gpu_seconds_count_only_while_a_row_is_unsent() -> None:
    from bench.idle_gpus import EngineSample as S
    from bench.idle_gpus import idle_figures

    # Two GPUs of cap 4, 10 rows; the window opens at the first request (t=1). GPU 1 idles
    # from 1 to 2 with rows unsent; from t=3 every row has been seen, so GPU 0 idling after
    # that is the engines' tail, not idle time.
    samples = [S(0.0, (0, 0), (0, 0), 0), S(1.0, (4, 0), (2, 0), 6), S(2.0, (4, 2), (0, 0), 8),
               S(3.0, (0, 2), (0, 0), 10), S(4.0, (0, 1), (0, 0), 10)]
    fig = idle_figures(samples, rows=10, cap=4, t_done=5.0)
    assert fig.idle_gpu_s == 1.0 and fig.job_gpu_s == 8.0 and fig.unsent_s == 2.0
    assert fig.idle_share == 1.0 / 8.0 and fig.ramp_idle_gpu_s == 1.0  # GPU 1 had not started
    assert fig.empty_slot_share == (4 + 2) / 4 / (2 * 2.0)
    assert idle_figures(samples[:1], 10, 4, 5.0).idle_share == 0.0


def test_idle_gpus_bench_runs_end_to_end_at_a_tiny_size() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "bench.idle_gpus", "--gpus", "2", "--prompts", "60",
         "--requests-per-s", "60"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert res.returncode in (0, 1), res.stdout + res.stderr  # 1 = a goal missed, not a crash
    assert "bench.idle_gpus (issue 37)" in res.stdout
    assert "2 GPUs, 60 prompts (sigma 0.8)" in res.stdout


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


def test_exports_bench_runs_end_to_end_at_a_tiny_size() -> None:
    pytest.importorskip("transformers", reason="the export extra is not installed")
    res = subprocess.run([sys.executable, "-m", "bench.exports", "--rows", "300"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode in (0, 1), res.stdout + res.stderr
    assert "bench.exports (issue 42)" in res.stdout and "ok 300 + errors 0 = 300" in res.stdout
    assert "0 of 300 differ from the engine's ids" in res.stdout
    assert "SpecForge build_eagle3_dataset" in res.stdout and "300 rows" in res.stdout


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


def test_request_shapes_run_on_a_live_engine_and_read_its_decode_lines(tmp_path: Path) -> None:
    # The shapes the GPU check compares (bench/request_shapes.py), each answered in full by a
    # simulated engine and measured from the engine's own decode lines at its cap.
    from bench.request_shapes import measure
    from config.launch_profile import load_profile
    from tests.simproc import launch

    sim = launch(tmp_path, load_profile("qwen36-27b").to_argv(),
                 {"SGLANG_ENABLE_SPEC_V2": "1", "FLEET_SIM_SPEED": "8",
                  "FLEET_SIM_CALIBRATION": "h200-dummy"})
    sim.wait_ready()
    try:
        got = measure(sim.url, 40, sim.log_path, str(ROOT / "tests/fixtures/tokenizer"), 300,
                      shapes=("chat", "generate", "chat+stop"))
    finally:
        sim.stop()
    assert [r["shape"] for r in got["runs"]] == ["chat", "generate", "chat+stop",
                                                 "chat+stop", "generate", "chat"]
    assert all(r["answered"] == 40 and r["failed"] == 0 for r in got["runs"])
    assert all(r["decode_lines_at_cap"] > 0 for r in got["runs"])
    assert got["vs_chat"]["chat"] == 1.0 and set(got["vs_chat"]) == {"chat", "generate",
                                                                      "chat+stop"}
