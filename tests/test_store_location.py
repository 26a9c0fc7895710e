"""Where the data lives: a store on the node is refused unless the operator allows it."""

from __future__ import annotations

import orjson
import pytest

from producer.cli import RET_JOB
from tests.conftest import follow_status, run_producer, wait_done, write_prompts
from workers.dataset.location import locate


@pytest.mark.parametrize(("store", "endpoint", "where"), [
    ("file:///data/fleet", None, "node"),
    ("s3://fleet/runs", None, "off-node"),
    ("s3://fleet/runs", "http://minio:9000", "node"),
    ("s3://fleet/runs", "http://127.0.0.1:9000", "node"),
    ("s3://fleet/runs", "http://[::1]:9000", "node"),
    ("s3://fleet/runs", "http://localhost:9000", "node"),
    ("s3://fleet/runs", "https://s3.eu-west-1.amazonaws.com", "off-node"),
    ("s3://fleet/runs", "https://10.0.0.5:9000", "off-node"),
])
def test_locate_says_whether_the_store_is_on_the_node(store, endpoint, where):
    assert locate(store, endpoint).where == where


def test_enqueue_refuses_a_store_on_the_node_unless_told_so(fleet_env, tmp_path, r):
    env = {k: v for k, v in fleet_env.items() if k != "FLEET_ALLOW_NODE_LOCAL_STORE"}
    src = write_prompts(tmp_path / "p.jsonl", 10)
    res = run_producer(env, "enqueue", str(src), "--job", "local", "--batch-size", "5")
    assert res.returncode == RET_JOB, res.stderr
    assert "FLEET_ALLOW_NODE_LOCAL_STORE=1" in res.stderr and "Traceback" not in res.stderr
    assert r.llen("gpu") == 0 and not (tmp_path / "store").exists()
    res = run_producer(env, "enqueue", str(src), "--job", "local", "--batch-size", "5",
                       "--allow-node-local-store")
    assert res.returncode == 0, res.stderr
    assert r.llen("gpu") == 2
    st = orjson.loads(run_producer(env, "status", "--job", "local", "--json").stdout)
    assert st["store"]["where"] == "node" and st["store"]["url"] == env["FLEET_STORE_URL"]


def test_enqueue_refuses_to_move_an_existing_job_to_another_store(fleet_env, tmp_path, r):
    src = write_prompts(tmp_path / "p.jsonl", 10)
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "moved", "--batch-size", "5")
    assert res.returncode == 0, res.stderr
    other = {**fleet_env, "FLEET_STORE_URL": (tmp_path / "other").as_uri()}
    res = run_producer(other, "enqueue", str(src), "--job", "moved", "--batch-size", "5")
    assert res.returncode == RET_JOB, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "already lives in the store" in lines[0], res.stderr
    assert r.hget("fleet:job:moved", "store_url").decode() == fleet_env["FLEET_STORE_URL"]
    assert not (tmp_path / "other").exists()


def test_a_worker_reads_the_jobs_own_store_and_says_when_it_cannot(
        fleet_env, tmp_path, r, make_workers):
    """A worker started with another store works on the job's recorded store; while that
    store cannot be read, ``status`` says so and the batches wait (never failed for good)."""
    src = write_prompts(tmp_path / "p.jsonl", 10)
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "far", "--batch-size", "5")
    assert res.returncode == 0, res.stderr
    store, hidden = tmp_path / "store", tmp_path / "store-away"
    store.rename(hidden)  # the job's store cannot be read for now
    make_workers([0], FLEET_STORE_URL=(tmp_path / "elsewhere").as_uri())
    st = follow_status(fleet_env, "far", lambda st: st["stalled"], 60, "stalled note")
    assert st["stalled"] and "cannot read job far in " + store.as_uri() in st["stalled"][0], st
    table = run_producer(fleet_env, "status", "--job", "far")
    assert "stalled" in table.stdout and "cannot read job far" in table.stdout, table.stdout
    hidden.rename(store)
    st = wait_done(fleet_env, "far", timeout_s=120)
    assert st["completed"] == 10 and st["failed"] == 0 and not st["stalled"], st
    assert not (tmp_path / "elsewhere" / "jobs").exists()


def test_a_job_enqueued_for_a_tools_profile_waits_for_a_worker_that_runs_it(
        fleet_env, tmp_path, r, make_workers):
    """FLEET_PROFILE on enqueue records the profile the job needs; a worker whose engine
    lacks its tool-call parser hands the batches back and says so in ``status``."""
    src = write_prompts(tmp_path / "p.jsonl", 6)
    env = {**fleet_env, "FLEET_PROFILE": "qwen36-27b-tools"}
    res = run_producer(env, "enqueue", str(src), "--job", "tools", "--batch-size", "3")
    assert res.returncode == 0, res.stderr
    assert r.hget("fleet:job:tools", "profile") == b"qwen36-27b-tools"
    make_workers([0])  # the default profile: no tool-call parser
    st = follow_status(fleet_env, "tools", lambda st: st["stalled"], 60, "stalled note")
    assert st["stalled"] and "needs tool-call-parser qwen3_coder" in st["stalled"][0], st
    assert st["completed"] == 0 and st["failed"] == 0, st
    make_workers([1], FLEET_PROFILE="qwen36-27b-tools")
    st = wait_done(fleet_env, "tools", timeout_s=120)
    assert st["completed"] == 6 and st["failed"] == 0, st
