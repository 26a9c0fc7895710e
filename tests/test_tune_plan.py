"""``tune plan`` and the throughput model behind it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workers.tune import throughput

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tests" / "fixtures" / "tune" / "snapshots" / "baseline_mamba_slots"


def _plan(*args: str) -> dict:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "workers.tune",
            "plan",
            "--gpus",
            "7",
            "--prompts",
            "913786",
            "--avg-output-tokens",
            "2490",
            "--json",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_plan_for_the_workloads_two_profiles_on_b200s():
    before = _plan(
        "--profile",
        "qwen36-27b-baseline",
        "--gpu-price-per-hour",
        "4",
        "--gpu-memory-mib",
        "183359",
    )
    after = _plan(
        "--profile", "qwen36-27b", "--gpu-price-per-hour", "4", "--gpu-memory-mib", "183359"
    )
    assert (before["running_per_gpu"], after["running_per_gpu"]) == (16, 40)
    assert (before["tok_s_per_gpu"], after["tok_s_per_gpu"]) == (2000, 3500)
    assert (before["tok_s_total"], after["tok_s_total"]) == (14000, 24500)
    # 913,786 x 2,490 tokens at 14,000 / 24,500 tok/s.
    assert (before["eta_hours"], after["eta_hours"]) == (45.1, 25.8)
    assert before["cost"] == pytest.approx(45.14 * 7 * 4, abs=2)
    assert after["predicted"]["mamba_slots"] == 200


def test_plan_calibrated_from_a_snapshot_uses_its_measured_throughput():
    out = _plan("--profile", "qwen36-27b", "--snapshot", str(BASELINE))
    assert out["running_per_gpu"] == 40
    # The snapshot's decode lines at its cap with a queue, less the first (it covers the ramp).
    assert "steady state 16->2003 tok/s; unmeasured above 16" in out["throughput_model"]
    assert out["tok_s_per_gpu"] == 3505


def test_throughput_curve_through_the_workloads_two_points():
    model = throughput.fit([(16, 2000.0), (40, 3500.0)])
    assert model.peak_tok_s == pytest.approx(7000, rel=1e-6)
    assert model.half_n == pytest.approx(40, rel=1e-6)
    # Two counts fix the curve's two numbers and test nothing: no knee is claimed from them.
    assert model.knee() is None and not model.shape_measured
    # A third steady-state count on the same curve is evidence of its knee.
    third = throughput.fit([(16, 2000.0), (40, 3500.0), (80, 7000.0 * 80 / 120)])
    assert third.shape_measured and third.knee() == 120


def test_throughput_curve_that_stops_growing_is_flat_and_one_point_keeps_the_prior_shape():
    flat = throughput.fit([(24, 3420.0), (32, 3400.0), (40, 3390.0)])
    assert flat.half_n == 0.0 and flat.marginal_share(40) == 0.0 and flat.saturated_at(40)
    scaled = throughput.fit([(16, 1000.0)])
    assert scaled.half_n == throughput.WORKLOAD.half_n
    assert scaled.tok_s(16) == pytest.approx(1000.0)
    # The prior's shape predicts above 16 but is no measured knee.
    assert scaled.knee() is None and not scaled.saturated_at(16)


def test_plan_holds_the_running_count_to_what_kv_admits_for_the_jobs_lengths():
    # The job's lengths size the KV need (SGLang's admission arithmetic, workers/tune/kv_floor):
    # the given profile and the tuner's alternative both run at most what their pool holds.
    out = _plan("--profile", "qwen36-27b-baseline", "--gpu-memory-mib", "183359",
                "--max-new-tokens", "7000", "--avg-prompt-tokens", "100")
    assert out["kv_need_per_request"] == 100 + 2490  # prompt + E[O^2] / 2E[O], geometric
    assert out["running_per_gpu"] == 16 <= out["kv_holds_requests"]
    assert out["running_bound"] == "cap"
    alt = out["tuner_alternative"]
    assert alt["running_per_gpu"] <= alt["kv_holds_requests"]
    assert alt["running_per_gpu"] == alt["predicted"]["max_running_requests"] > 16
    # Traces of the whole context on a small pool (the last --avg-output-tokens wins): KV, not
    # the cap, binds.
    small = _plan("--profile", "qwen36-27b", "--gpu-memory-mib", "120000",
                  "--avg-output-tokens", "8000")
    assert small["running_bound"] == "kv"
    assert small["running_per_gpu"] == small["kv_holds_requests"]
    assert small["running_per_gpu"] < small["predicted"]["max_running_requests"]
