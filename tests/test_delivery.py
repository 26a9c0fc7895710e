"""Nothing lost, nothing doubled: redelivery, leases, engine crashes, poison prompts, Redis loss."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from producer.localfleet import start_redis
from tests.conftest import run_producer, wait_done, write_prompts


def _rows(env: dict[str, str], job: str) -> list[dict]:
    store = Path(env["FLEET_STORE_URL"].removeprefix("file://"))
    return [orjson.loads(x) for f in sorted((store / f"jobs/{job}/results").glob("*.jsonl"))
            for x in f.read_bytes().splitlines()]


def _verify(env: dict[str, str], job: str) -> dict:
    res = run_producer(env, "verify", "--job", job, "--json")
    return orjson.loads(res.stdout)


def _engine_requests(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_requests_total"))


def _wait_for(pred, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not pred():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - start


def test_batch_of_sigkilled_worker_returns_within_60s_and_keeps_progress(
        fleet_env, make_workers, tmp_path, r):
    # Slow enough that the first rows are recorded (answered rows are spilled every few
    # seconds) long before the batch could finish.
    (a,) = make_workers([0], FLEET_SIM_SPEED="1", FLEET_SIM_MEAN_OUTPUT_TOKENS="300")
    src = write_prompts(tmp_path / "p.jsonl", 200)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "kill", "--batch-size",
                        "200").returncode == 0
    _wait_for(lambda: int(r.hget("fleet:job:kill:stats", "completed") or 0) >= 30, 60,
              "progress before the kill")
    a.kill()
    killed_at = time.monotonic()
    (b,) = make_workers([1], FLEET_SIM_SPEED="10", FLEET_SIM_MEAN_OUTPUT_TOKENS="60")
    _wait_for(lambda: (r.get("fleet:job:kill:owner:0") or b"").startswith(f"{b.node}|".encode()),
              90, "redelivery to the second worker")
    assert time.monotonic() - killed_at < 60
    wait_done(fleet_env, "kill", timeout_s=120)
    report = _verify(fleet_env, "kill")
    assert report["ok"] and report["duplicates"] == 0 and report["rows"] == 200
    nodes = {row["node"] for row in _rows(fleet_env, "kill")}
    assert nodes == {a.node, b.node}  # rows finished before the kill were kept, not redone


def test_live_batch_longer_than_the_lease_is_never_run_twice(fleet_env, make_workers, tmp_path,
                                                            r):
    # Splits off: the idle worker would take the batch's unsent rows (tests/test_split.py),
    # and this test counts what a lapsed lease alone makes it send.
    fast_lease = {"FLEET_VISIBILITY_TIMEOUT_S": "2", "FLEET_SWEEP_INTERVAL_S": "1",
                  "FLEET_LEASE_RENEW_S": "0.5", "FLEET_BATCHES_PER_GPU": "1",
                  "FLEET_SPLIT_MIN_ROWS": "0"}
    (a,) = make_workers([0], FLEET_SIM_SPEED="1", FLEET_SIM_MEAN_OUTPUT_TOKENS="400",
                        **fast_lease)
    src = write_prompts(tmp_path / "p.jsonl", 100)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "slow", "--batch-size",
                        "100").returncode == 0
    _wait_for(lambda: r.exists("fleet:job:slow:owner:0"), 30, "batch start")
    started = time.monotonic()
    (b,) = make_workers([1], **fast_lease)  # an idle worker whose sweeps would steal the batch
    wait_done(fleet_env, "slow", timeout_s=120)
    assert time.monotonic() - started > 6  # the batch outlived the 2 s lease three times
    base = int(fleet_env["FLEET_ENGINE_BASE_PORT"])
    assert _engine_requests(base + 1) == 0
    assert _engine_requests(base) == 100
    assert {row["node"] for row in _rows(fleet_env, "slow")} == {a.node}


def _run_rows(env: dict[str, str], tmp_path: Path, rows: list[dict], job: str,
              timeout_s: float) -> dict:
    """Enqueue ``rows`` as ``job`` and wait until it is done; return its last status."""
    path = tmp_path / "special.jsonl"
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in rows))
    res = run_producer(env, "enqueue", str(path), "--job", job)
    assert res.returncode == 0, res.stderr
    return wait_done(env, job, timeout_s=timeout_s)


def test_poison_prompt_is_bisected_out_and_the_rest_completes(fleet_env, make_workers, tmp_path,
                                                             r):
    make_workers([0], FLEET_SIM_SPEED="2")
    rows = [{"id": f"q{i}", "prompt": f"question {i}"} for i in range(12)]
    rows[7]["prompt"] = "please __SIM_CRASH__ now"
    st = _run_rows(fleet_env, tmp_path, rows, "poison", 180)
    assert (st["completed"], st["failed"], st["quarantined"]) == (11, 0, 1)
    out = _rows(fleet_env, "poison")
    assert out[7]["status"] == "failed" and "poison prompt" in out[7]["error"]
    assert all(x["status"] == "ok" for i, x in enumerate(out) if i != 7)
    assert _verify(fleet_env, "poison")["ok"]


def test_hung_request_times_out_and_rejected_prompt_is_quarantined_at_once(
        fleet_env, make_workers, tmp_path, r):
    make_workers([0], FLEET_REQUEST_TIMEOUT_S="2", FLEET_RETRY_MAX_ATTEMPTS="2",
                 FLEET_RETRY_BASE_S="0.1")
    rows = [{"prompt": f"fine {i}"} for i in range(10)]
    rows[3]["prompt"] = "this one __SIM_HANG__ forever"
    rows[6]["prompt"] = "x" * 40000  # ~10k tokens: longer than the 8192-token context
    st = _run_rows(fleet_env, tmp_path, rows, "hang", 120)
    # The hung prompt fails; the engine's 400 is quarantined (docs/sglang.md).
    assert (st["completed"], st["failed"], st["quarantined"]) == (8, 1, 1)
    out = _rows(fleet_env, "hang")
    assert "gave up after 2 attempts" in out[3]["error"]
    assert out[6]["error"].startswith("engine rejected the prompt:")


def test_hung_engine_is_restarted_by_the_stall_watch_and_its_prompt_quarantined(
        fleet_env, make_workers, tmp_path, r):
    # The engine stays up and answers /health, but its only running request never produces a
    # token: only the decode counter in /metrics shows the hang.
    (worker,) = make_workers([0], FLEET_ENGINE_STALL_TIMEOUT_S="2", FLEET_REQUEST_TIMEOUT_S="600",
                             FLEET_POISON_CRASHES="2")
    rows = [{"prompt": f"fine {i}"} for i in range(6)]
    rows[2]["prompt"] = "this one __SIM_HANG__ forever"
    st = _run_rows(fleet_env, tmp_path, rows, "stall", 120)
    assert (st["completed"], st["failed"], st["quarantined"]) == (5, 0, 1)
    out = _rows(fleet_env, "stall")
    assert "poison prompt" in out[2]["error"] and "crashed 2 times" in out[2]["error"]
    log = worker.log_path.read_text()
    assert log.count("no token progress for 2 s") == 2
    assert _verify(fleet_env, "stall")["ok"]


def test_requeue_truncated_rows_with_a_larger_cap(fleet_env, make_workers, tmp_path, r):
    make_workers([0], FLEET_SIM_SPEED="20")
    src = write_prompts(tmp_path / "p.jsonl", 60)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "trunc", "--batch-size", "20",
                        "--max-new-tokens", "4").returncode == 0
    st = wait_done(fleet_env, "trunc")
    assert st["truncated"] > 40
    before = _verify(fleet_env, "trunc")
    assert before["truncated"] == st["truncated"] and before["ok"]
    res = run_producer(fleet_env, "requeue-failed", "--job", "trunc", "--truncated",
                       "--max-new-tokens", "5000")
    assert res.returncode == 0, res.stderr
    assert f"requeued {st['truncated']} rows (truncated {st['truncated']})" in res.stderr
    st2 = wait_done(fleet_env, "trunc")
    after = _verify(fleet_env, "trunc")
    assert after["ok"] and after["duplicates"] == 0 and after["rows"] == 60
    assert after["truncated"] == st2["truncated"] < 5
    assert st2["completed"] == 60


@pytest.fixture()
def own_redis(tmp_path):
    server = start_redis(tmp_path / "own-redis")
    yield server
    server.stop()


def test_redis_restarted_empty_mid_job_is_restored_by_enqueue(fleet_env, make_workers, tmp_path,
                                                             own_redis):
    env = {**fleet_env, "FLEET_REDIS_URL": own_redis.url}
    client = own_redis.client()
    worker_env = {"FLEET_REDIS_URL": own_redis.url, "FLEET_SIM_SPEED": "3"}
    (w,) = make_workers([0], wait=False, **worker_env)
    src = write_prompts(tmp_path / "p.jsonl", 300)
    assert run_producer(env, "enqueue", str(src), "--job", "loss", "--batch-size",
                        "30").returncode == 0
    _wait_for(lambda: client.scard("fleet:job:loss:done") >= 2, 90, "some batches done")
    own_redis.stop()
    restarted = start_redis(tmp_path / "own-redis", port=own_redis.port)
    own_redis.proc = restarted.proc
    # Empty of the job (a worker may already have written its heartbeat again).
    assert not restarted.client().keys("fleet:job:loss*")
    res = run_producer(env, "enqueue", str(src), "--job", "loss")
    assert res.returncode == 0, res.stderr
    fresh = restarted.client()
    deadline = time.monotonic() + 180
    while fresh.scard("fleet:job:loss:done") < 10:
        assert time.monotonic() < deadline, "job not finished after the Redis restart"
        if w.proc.poll() is not None:
            # Celery 5.7 can die in its own connection-loss cleanup (restore_unacked after
            # collect()); in a deployment the supervisor restarts it, as we do here.
            (w,) = make_workers([0], wait=False, **worker_env)
        time.sleep(0.5)
    st = wait_done(env, "loss", timeout_s=60)
    assert st["completed"] + st["failed"] == 300
    report = _verify(env, "loss")
    assert report["ok"] and report["duplicates"] == 0 and report["rows"] == 300


def test_status_json_has_the_contract_keys(fleet_env, tmp_path, r: redis.Redis):
    src = write_prompts(tmp_path / "p.jsonl", 10)
    run_producer(fleet_env, "enqueue", str(src), "--job", "keys")
    st = orjson.loads(run_producer(fleet_env, "status", "--job", "keys", "--json").stdout)
    for key in ("total", "completed", "failed", "rate_per_sec", "tokens_per_sec", "eta_hours",
                "done"):
        assert key in st
    assert st["total"] == 10 and st["done"] is False
