"""``tune auto`` end to end on the simulator: real Redis, real Celery workers, real sim engines.

The workers start on the run's first profile (80 Mamba slots under extra_buffer + MTP: the
engine caps itself at 16 running). The tuner must find the cap, re-tune the canary, keep the
better profile and roll it out to the other GPU one at a time while the job keeps running.
"""

from __future__ import annotations

import json

from config.launch_profile import load_profile
from tests.conftest import ROOT, run_producer, run_tune, wait_done, write_prompts
from workers.node.heartbeat import read_heartbeats
from workers.tune import snapshot
from workers.tune.apply import is_better, run_trial
from workers.tune.auto import base_name, next_profile
from workers.tune.diagnose import diagnose
from workers.tune.fleet import Measurement, Timing

SNAPSHOTS = ROOT / "tests" / "fixtures" / "tune" / "snapshots"

SIM = {
    "FLEET_PROFILE": "qwen36-27b-baseline",
    "FLEET_SIM_SPEED": "8",
    "FLEET_SIM_MEAN_OUTPUT_TOKENS": "2490",
    # A canary restart should not wait out the default 30 s grace for in-flight requests.
    "FLEET_ENGINE_STOP_GRACE_S": "2",
}


def test_next_profile_applies_the_recommended_flags_under_a_round_name():
    current = load_profile("qwen36-27b-baseline")
    d = diagnose(snapshot.load(SNAPSHOTS / "baseline_mamba_slots"))
    new = next_profile(current, d, 1)
    assert new is not None and new.name == "qwen36-27b-baseline-tune1"
    assert new.flags["disable-radix-cache"] is True
    assert "mamba-scheduler-strategy" not in new.flags
    assert new.flags["max-running-requests"] == d.recommendation.flags["max-running-requests"]
    assert new.env == current.env and new.flags["model-path"] == current.flags["model-path"]
    assert base_name("qwen36-27b-baseline-tune12") == "qwen36-27b-baseline"


def test_next_profile_leaves_lossy_levers_and_client_limits_to_a_person():
    gpu_memory = diagnose(snapshot.load(SNAPSHOTS / "gpu_memory_h100"))
    current = load_profile("qwen36-27b")
    assert next_profile(current, gpu_memory, 1) is None
    lossy = next_profile(current, gpu_memory, 1, allow_lossy=True)
    assert lossy is not None and lossy.flags["mamba-ssm-dtype"] == "bfloat16"
    client = diagnose(snapshot.load(SNAPSHOTS / "client_concurrency_underscore"))
    assert next_profile(current, client, 1) is None  # the engine needs no restart
    pinned = current.model_copy(update={"client_concurrency": 24})
    raised = next_profile(pinned, client, 1)
    assert raised is not None and raised.client_concurrency == 51


def test_a_trial_is_kept_only_for_a_real_gain():
    assert is_better(2000.0, 2100.0) and not is_better(2000.0, 2099.0)
    assert not is_better(2000.0, 1500.0)


class _Canary:
    """The two things a trial asks of a fleet, for one engine whose rate depends on its
    profile: relaunch (recorded) and a measurement window (the engine's counter, full)."""

    def __init__(self, rates: dict[str, float], full_share: float = 1.0) -> None:
        self.rates, self.profile, self.launched = rates, "old", []
        self.full_share = full_share

    def relaunch(self, node: str, profile) -> None:
        self.profile = profile.name
        self.launched.append(profile.name)

    def wait_profile(self, node: str, name: str, timeout_s: float) -> None:
        assert self.profile == name

    def wait_busy(self, node: str, timeout_s: float, poll_s: float) -> bool:
        return True

    def measure(self, node: str, window_s: float) -> Measurement:
        rate = self.rates[self.profile]
        share = 1.0 if self.profile == "old" else self.full_share
        return Measurement(rate, window_s, "engine sglang:realtime_tokens_total{mode=decode}",
                           rate, share)


def test_a_relaunch_that_measures_worse_is_reported_and_rolled_back():
    old = load_profile("qwen36-27b-baseline").model_copy(update={"name": "old"})
    new = old.model_copy(update={"name": "new"})
    timing = Timing(window_s=1.0, settle_timeout_s=1.0, restart_timeout_s=1.0, poll_s=0.01)
    worse = _Canary({"old": 432.0, "new": 400.0})
    trial = run_trial(worse, "gpu0@h200", old, new, timing)
    assert not trial.kept and worse.launched == ["new", "old"] and worse.profile == "old"
    assert (trial.before_tok_s, trial.after_tok_s) == (432.0, 400.0)
    assert "rolled back" in trial.reason and trial.measured["saturated_share"] == 1.0
    assert trial.measured["steady"] and "steady state" not in trial.reason
    better = _Canary({"old": 432.0, "new": 700.0})
    kept = run_trial(better, "gpu0@h200", old, new, timing)
    assert kept.kept and better.launched == ["new"] and "x1.62" in kept.reason
    # A new cap the client never filled: the trial says its figure is not at steady state.
    unfilled = _Canary({"old": 432.0, "new": 700.0}, full_share=0.1)
    loose = run_trial(unfilled, "gpu0@h200", old, new, timing)
    assert loose.kept and not loose.measured["steady"]
    assert "not at steady state" in loose.reason and "10%" in loose.reason


def test_auto_lifts_baseline_throughput_175x_and_loses_no_prompt(
    fleet_env, make_workers, tmp_path, r
):
    env = {**fleet_env, **SIM}
    make_workers([0, 1], **SIM)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 1100)
    res = run_producer(
        env,
        "enqueue",
        str(prompts),
        "--job",
        "tune",
        "--batch-size",
        "100",
        "--max-new-tokens",
        "4000",
    )
    assert res.returncode == 0, res.stderr
    res = run_tune(
        env,
        "auto",
        "--canary",
        "gpu0",
        "--window-s",
        "3",
        "--settle-timeout-s",
        "30",
        "--restart-timeout-s",
        "60",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    print(json.dumps({k: v for k, v in report.items() if k != "diagnoses"}, indent=1))
    first = report["diagnoses"][0]
    assert (first["binding_constraint"], first["cause"]) == ("running_cap", "mamba_slots")
    assert 1 <= len(report["trials"]) <= 3
    assert report["gain"] >= 1.75, report
    final = report["final_profile"]
    assert final.startswith("qwen36-27b-baseline-tune")
    assert report["rolled_out"] == ["gpu1@test1"]
    assert {b["profile"] for b in read_heartbeats(r)} == {final}
    st = wait_done(env, "tune", timeout_s=240)
    assert st["completed"] == 1100 and st["failed"] == 0
    verify = json.loads(run_producer(env, "verify", "--job", "tune", "--json").stdout)
    assert verify["ok"] and verify["missing"] == 0 and verify["duplicates"] == 0
