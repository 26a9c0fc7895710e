"""Nothing lost under real operations: faults mixed with what operators do (pause, resume,
re-enqueue, stop), checked from the store afterwards."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import orjson
import redis

from tests.conftest import run_producer, wait_done, write_prompts
from tests.test_delivery import _engine_requests, _rows, _verify, _wait_for


def _status(env: dict[str, str], job: str) -> dict:
    return orjson.loads(run_producer(env, "status", "--job", job, "--json").stdout)


def _assert_store_and_counters_agree(env: dict[str, str], job: str, total: int) -> None:
    report = _verify(env, job)
    assert report["ok"] and report["duplicates"] == 0 and report["rows"] == total, report
    st = _status(env, job)
    counts = report["counts"]
    assert (st["completed"], st["failed"], st["quarantined"]) == (
        total - counts["failed"] - counts["quarantined"], counts["failed"],
        counts["quarantined"]), (st, counts)


def test_lost_queue_then_pause_and_resume_resends_every_batch(fleet_env, make_workers,
                                                              tmp_path, r: redis.Redis):
    src = write_prompts(tmp_path / "p.jsonl", 60)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "lq", "--batch-size",
                        "10").returncode == 0
    r.delete("gpu")  # a failover that kept the job's records and lost the queue
    assert run_producer(fleet_env, "pause", "--job", "lq").returncode == 0
    res = run_producer(fleet_env, "resume", "--job", "lq")
    assert res.returncode == 0, res.stderr
    assert "enqueued 6" in res.stderr, res.stderr  # nothing remembered says they are queued
    make_workers([0])
    wait_done(fleet_env, "lq", timeout_s=120)
    _assert_store_and_counters_agree(fleet_env, "lq", 60)


def test_a_result_deleted_from_the_store_is_generated_again(fleet_env, make_workers, tmp_path,
                                                            r: redis.Redis):
    make_workers([0])
    src = write_prompts(tmp_path / "p.jsonl", 40)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "del", "--batch-size",
                        "10").returncode == 0
    wait_done(fleet_env, "del", timeout_s=120)
    store = Path(fleet_env["FLEET_STORE_URL"].removeprefix("file://"))
    (store / "jobs/del/results/b000002.jsonl").unlink()
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "del")
    assert res.returncode == 0 and "enqueued 1" in res.stderr, res.stderr
    _wait_for(lambda: (store / "jobs/del/results/b000002.jsonl").exists(), 60,
              "the deleted batch to be generated again")
    wait_done(fleet_env, "del", timeout_s=60)
    _assert_store_and_counters_agree(fleet_env, "del", 40)


def test_a_frozen_worker_past_its_lease_stops_sending_once_it_wakes(fleet_env, make_workers,
                                                                    tmp_path, r: redis.Redis):
    lease = {"FLEET_VISIBILITY_TIMEOUT_S": "6", "FLEET_LEASE_RENEW_S": "1",
             "FLEET_SWEEP_INTERVAL_S": "1"}
    (a,) = make_workers([0], FLEET_SIM_SPEED="1", FLEET_SIM_MEAN_OUTPUT_TOKENS="300",
                        FLEET_BATCHES_PER_GPU="1", **lease)
    src = write_prompts(tmp_path / "p.jsonl", 120)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "frz", "--batch-size", "120",
                        "--max-new-tokens", "400").returncode == 0
    _wait_for(lambda: int(r.hget("fleet:job:frz:stats", "completed") or 0) >= 10, 60,
              "progress before the freeze")
    os.kill(a.proc.pid, signal.SIGSTOP)
    for child in _pool_children(a.proc.pid):
        os.kill(child, signal.SIGSTOP)
    try:
        (b,) = make_workers([1], FLEET_SIM_SPEED="10", FLEET_SIM_MEAN_OUTPUT_TOKENS="300",
                            **lease)
        _wait_for(lambda: (r.get("fleet:job:frz:owner:0") or b"").startswith(
            f"{b.node}|".encode()), 60, "the batch taken over after the lease")
    finally:
        for child in _pool_children(a.proc.pid):
            os.kill(child, signal.SIGCONT)
        os.kill(a.proc.pid, signal.SIGCONT)
    port_a = int(fleet_env["FLEET_ENGINE_BASE_PORT"])
    time.sleep(4)  # the woken run notices within one renewal and stops
    sent = _engine_requests(port_a)
    time.sleep(3)
    assert _engine_requests(port_a) == sent, "the woken run kept sending"
    wait_done(fleet_env, "frz", timeout_s=120)
    _assert_store_and_counters_agree(fleet_env, "frz", 120)


def _pool_children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[-1].split()[1]) == pid and "celery" in (
                    entry / "cmdline").read_bytes().decode(errors="replace"):
                out.append(int(entry.name))
    return out


def _engine_pid(r: redis.Redis, node: str) -> int:
    beat = orjson.loads(r.get(f"fleet:worker:{node}"))
    return int(beat["engine_pid"])


def test_a_gpu_whose_engine_cannot_come_back_lets_go_and_the_job_finishes(
        fleet_env, make_workers, tmp_path, r: redis.Redis):
    # Long enough (~200 tokens per prompt) that the job is far from done when GPU 0 dies.
    (dead, alive) = make_workers([0, 1], FLEET_SIM_SPEED="2", FLEET_SIM_MEAN_OUTPUT_TOKENS="200",
                                 FLEET_ENGINE_WAIT_S="5")
    src = write_prompts(tmp_path / "p.jsonl", 160)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "dg", "--batch-size",
                        "20").returncode == 0
    _wait_for(lambda: (r.get("fleet:job:dg:owner:0") or r.get("fleet:job:dg:owner:1")),
              30, "batches to start")
    port = int(fleet_env["FLEET_ENGINE_BASE_PORT"])  # GPU 0's engine
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    os.killpg(_engine_pid(r, dead.node), signal.SIGKILL)
    _wait_for(lambda: _bind(squatter, port), 10, "the dead engine's port")
    squatter.listen(1)  # its port is taken: every restart of the engine fails
    outage = time.monotonic()
    try:
        wait_done(fleet_env, "dg", timeout_s=150)
    finally:
        squatter.close()
    # The other GPU may finish the job first: GPU 0's monitor, whose check was already past
    # the engine's liveness when the engine died, waits out its probe of the squatter
    # (FLEET_ENGINE_PROBE_TIMEOUT_S) before it sees the engine gone.
    log_path = tmp_path / "logs" / "worker-gpu0.log"
    _wait_for(lambda: "taking no new batches" in log_path.read_text(), 30,
              "GPU 0 to stop taking batches")
    log = log_path.read_text()
    took = [line for line in log.splitlines() if "fleet.run_batch" in line and "received" in line]
    # Only what it had prefetched before the outage may arrive; nothing after the gate closed.
    assert len(took) <= 4 + 2, took
    assert time.monotonic() - outage < 150
    _assert_store_and_counters_agree(fleet_env, "dg", 160)


def _bind(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def test_a_batch_whose_pool_process_dies_is_counted_then_quarantined(fleet_env, make_workers,
                                                                     tmp_path, r: redis.Redis):
    make_workers([0], FLEET_SIM_SPEED="1", FLEET_SIM_MEAN_OUTPUT_TOKENS="2000",
                 FLEET_BATCHES_PER_GPU="1", FLEET_BATCH_CHILD_DEATHS="2")
    src = write_prompts(tmp_path / "p.jsonl", 10)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "pk", "--batch-size", "10",
                        "--max-new-tokens", "2000").returncode == 0
    for death in (1, 2):
        _wait_for(lambda: r.get("fleet:job:pk:owner:0") is not None, 60, "the batch to run")
        token = r.get("fleet:job:pk:owner:0").decode()
        os.kill(int(token.split("|")[2]), signal.SIGKILL)  # the pool process running it
        _wait_for(lambda d=death: int(r.hget("fleet:job:pk:child_deaths", 0) or 0) == d, 30,
                  "the death to be counted")
        _wait_for(lambda t=token: r.get("fleet:job:pk:owner:0") != t.encode(), 60,
                  "the dead run's claim to go")
    wait_done(fleet_env, "pk", timeout_s=120)
    rows = _rows(fleet_env, "pk")
    assert len(rows) == 10
    assert all(x["status"] == "failed" and "poison batch" in x["error"] for x in rows)


def test_a_stopping_worker_hands_its_batch_back_with_answered_prompts_kept(
        fleet_env, make_workers, tmp_path, r: redis.Redis):
    (a,) = make_workers([0], FLEET_SIM_SPEED="1", FLEET_SIM_MEAN_OUTPUT_TOKENS="200",
                        FLEET_BATCHES_PER_GPU="1")
    src = write_prompts(tmp_path / "p.jsonl", 150)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "hb", "--batch-size", "150",
                        "--max-new-tokens", "400").returncode == 0
    _wait_for(lambda: int(r.hget("fleet:job:hb:stats", "completed") or 0) >= 10, 60,
              "progress before the stop")
    t0 = time.monotonic()
    a.proc.send_signal(signal.SIGTERM)  # warm shutdown, as `docker stop` does
    a.proc.wait(timeout=60)
    assert time.monotonic() - t0 < 30, "the worker waited for its batch instead of handing back"
    assert r.llen("gpu") + r.llen("gpu0") == 1  # the batch is back in a queue
    assert r.hlen("fleet:job:hb:prog:0") >= 10  # with its answered prompts
    (b,) = make_workers([1], FLEET_SIM_SPEED="10")
    wait_done(fleet_env, "hb", timeout_s=120)
    _assert_store_and_counters_agree(fleet_env, "hb", 150)
    assert {x["node"] for x in _rows(fleet_env, "hb")} == {a.node, b.node}
