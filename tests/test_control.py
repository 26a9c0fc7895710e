"""Job control: pause, resume, cancel and the job list."""

from __future__ import annotations

import time

import orjson
import pytest

from config.launch_profile import load_profile
from config.settings import Settings
from tests.conftest import run_producer, wait_done, write_prompts
from workers.engine.relaunch_guard import LEVERS, RelaunchRefused, vet
from workers.node.heartbeat import read_heartbeats
from workers.wiring.celery_app import make_app
from workers.wiring.control import send_relaunch


def _jobs(env: dict[str, str]) -> dict[str, dict]:
    res = run_producer(env, "jobs", "--json")
    assert res.returncode == 0, res.stderr
    return {j["job"]: j for j in orjson.loads(res.stdout)}


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_pause_stops_new_batches_and_resume_finishes_the_job(fleet_env, make_workers, tmp_path,
                                                             r):
    make_workers([0], FLEET_SIM_SPEED="1", FLEET_BATCHES_PER_GPU="1")
    src = write_prompts(tmp_path / "p.jsonl", 200)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "pz", "--batch-size",
                        "20").returncode == 0
    _wait(lambda: r.scard("fleet:job:pz:done") >= 1, 60, "a first batch")
    res = run_producer(fleet_env, "pause", "--job", "pz")
    assert res.returncode == 0, res.stderr
    assert r.llen("gpu") == 0
    _wait(lambda: not r.keys("fleet:job:pz:owner:*"), 60, "running batches to finish")
    done_at_pause = r.scard("fleet:job:pz:done")
    time.sleep(2)
    assert r.scard("fleet:job:pz:done") == done_at_pause < 10
    assert _jobs(fleet_env)["pz"]["state"] == "paused"
    res = run_producer(fleet_env, "resume", "--job", "pz")
    assert res.returncode == 0, res.stderr
    assert f"already done {done_at_pause}" in res.stderr
    wait_done(fleet_env, "pz", timeout_s=180)
    report = orjson.loads(run_producer(fleet_env, "verify", "--job", "pz", "--json").stdout)
    assert report["ok"] and report["duplicates"] == 0
    assert _jobs(fleet_env)["pz"]["state"] == "done"  # resumed, then finished


def test_cancel_removes_queued_batches_and_stops_running_ones(fleet_env, make_workers, tmp_path,
                                                              r):
    make_workers([0], FLEET_SIM_SPEED="1", FLEET_SIM_MEAN_OUTPUT_TOKENS="3000",
                 FLEET_BATCHES_PER_GPU="1")
    src = write_prompts(tmp_path / "p.jsonl", 100)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "cx", "--batch-size",
                        "20", "--max-new-tokens", "3000").returncode == 0
    _wait(lambda: r.exists("fleet:job:cx:owner:0"), 60, "the first batch")
    res = run_producer(fleet_env, "cancel", "--job", "cx")
    assert res.returncode == 0, res.stderr
    # 4 were queued; the worker may already hold one more than it runs (the prefetched one is
    # dropped when it starts, since the job is cancelled).
    assert "4 queued batches removed" in res.stderr or "3 queued batches removed" in res.stderr
    _wait(lambda: not r.keys("fleet:job:cx:owner:*"), 30, "the running batch to stop")
    assert r.llen("gpu") == 0
    assert r.scard("fleet:job:cx:done") == 0
    job = _jobs(fleet_env)["cx"]
    assert job["state"] == "cancelled" and job["completed"] < 100


# --- fleet_relaunch: the control path refuses hostile payloads (engine/relaunch_guard.py) --

HOSTILE = {
    "name": "qwen36-27b-tune9",
    "flags": {**load_profile("qwen36-27b").flags, "model-path": "evil/repo",
              "trust-remote-code": True},
    "env": {"HF_HUB_OFFLINE": "0"},
}


def test_relaunch_guard_refuses_model_swaps_code_flags_env_and_path_names():
    known = [load_profile("qwen36-27b")]
    base = known[0]
    payloads = [
        HOSTILE,
        {**HOSTILE, "env": dict(base.env)},  # the flags alone are enough to refuse
        {"name": "qwen36-27b", "flags": {**base.flags, "model-path": "evil/repo"}},
        {"name": "x", "flags": dict(base.flags), "env": {**base.env, "LD_PRELOAD": "/x.so"}},
        {"name": "qwen36-27b", "env": {"HF_HUB_OFFLINE": "0"}},
        {"name": "../../tmp/evil", "flags": {}},
        {"name": "ok\n", "flags": dict(base.flags)},
        {"name": "x", "flags": {**base.flags, "kv-cache-dtype": "--trust-remote-code"}},
        {"name": "x", "flags": {**base.flags, "max-running-requests": True}},
        {"name": "x", "flags": dict(base.flags), "client_concurrency": 10**6},
        {"name": "x", "flags": dict(base.flags), "argv": ["--trust-remote-code"]},
        ["not", "an", "object"],
    ]
    for payload in payloads:
        with pytest.raises(RelaunchRefused):
            vet(payload, known)


def test_relaunch_guard_accepts_tuner_levers_and_known_names_with_local_env():
    base = load_profile("qwen36-27b-baseline")
    tuned = base.with_flags("qwen36-27b-baseline-tune1", max_mamba_cache_size=200,
                            max_running_requests=40, mem_fraction_static=0.9,
                            mamba_scheduler_strategy=None, disable_radix_cache=True)
    new = vet(tuned.model_dump(), [base])
    assert new.name == tuned.name and new.flags == tuned.flags and new.env == base.env
    # By name alone: the worker's own copy of a profile under config/profiles/.
    assert vet({"name": "qwen36-27b"}, [base]) == load_profile("qwen36-27b")
    # A tuner profile the worker validated before can be named again (roll-out, roll-back).
    assert vet({"name": tuned.name}, [new, base]) == new


def test_every_tuner_lever_is_allowed_by_the_guard():
    from workers.tune.levers import BF16_SSM, FP8_KV, NO_RADIX

    for changes in (NO_RADIX, BF16_SSM, FP8_KV):
        for key, value in changes.items():
            assert key in LEVERS and (value is None or LEVERS[key](value)), key
    for key in ("max-running-requests", "max-mamba-cache-size", "mem-fraction-static"):
        assert key in LEVERS


def _broadcast(env: dict[str, str], node: str, payload: object) -> dict:
    app = make_app(Settings(redis_url=env["FLEET_REDIS_URL"]))
    answer = send_relaunch(app, node, payload, timeout_s=30)
    app.close()
    assert answer is not None, f"{node} gave no answer"
    return answer


def test_a_hostile_relaunch_through_redis_is_refused_by_the_worker(fleet_env, make_workers, r):
    (w,) = make_workers([0])
    node = w.node
    before = next(b for b in read_heartbeats(r) if b["node"] == node)
    answer = _broadcast(fleet_env, node, HOSTILE)
    assert answer["ok"] is False and "levers" in answer["error"], answer
    swap = {"name": before["profile"],
            "flags": {**load_profile(before["profile"]).flags, "model-path": "evil/repo"}}
    answer = _broadcast(fleet_env, node, swap)
    assert answer["ok"] is False and "other flags" in answer["error"], answer
    # The engine was never restarted: same process, same profile, after a few health checks.
    time.sleep(3 * float(fleet_env["FLEET_ENGINE_HEALTH_INTERVAL_S"]))
    after = next(b for b in read_heartbeats(r) if b["node"] == node)
    assert (after["engine_pid"], after["engine_restarts"], after["profile"]) == (
        before["engine_pid"], before["engine_restarts"], before["profile"])
    # A lever change under a new name is taken (so the refusals above are the guard's doing).
    tuned = load_profile(before["profile"]).with_flags("t-tune1", max_running_requests=8)
    assert _broadcast(fleet_env, node, tuned.model_dump())["ok"] is True
    _wait(lambda: any(b["node"] == node and b["profile"] == "t-tune1"
                      and b["engine_state"] == "healthy" for b in read_heartbeats(r)),
          60, "the tuned profile")
