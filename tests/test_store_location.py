"""Where the data lives: a store on the node is refused unless the operator allows it."""

from __future__ import annotations

import orjson
import pytest

from producer.cli import RET_JOB
from tests.conftest import run_producer, write_prompts
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
