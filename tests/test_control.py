"""Job control: pause, resume, cancel and the job list."""

from __future__ import annotations

import time

import orjson

from tests.conftest import run_producer, wait_done, write_prompts


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
    make_workers([0], FLEET_SIM_SPEED="3", FLEET_BATCHES_PER_GPU="1")
    src = write_prompts(tmp_path / "p.jsonl", 200)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "pz", "--batch-size",
                        "20").returncode == 0
    _wait(lambda: r.scard("fleet:job:pz:done") >= 1, 60, "a first batch")
    res = run_producer(fleet_env, "pause", "--job", "pz")
    assert res.returncode == 0, res.stderr
    assert r.llen("gpu") == 0
    _wait(lambda: r.hlen("fleet:job:pz:running") == 0, 60, "running batches to finish")
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
    assert _jobs(fleet_env)["pz"]["state"] == "running"


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
