"""A store outage: results wait (with backoff) until the store is back; nothing acked early."""

from __future__ import annotations

import time
import uuid

import orjson

from config.settings import Settings
from tests.conftest import run_producer, wait_done, write_prompts
from tests.s3fixture import AWS_ENV
from tests.tcpproxy import TcpProxy
from workers.dataset.store import store_policy
from workers.retry import RetryPolicy, backoff_s


def test_retry_budget_outlasts_a_30_second_outage():
    policy = store_policy(Settings())
    no_jitter = RetryPolicy(policy.max_attempts, policy.base_s, policy.max_s, jitter=0.0)
    waited = sum(backoff_s(a, no_jitter) for a in range(1, policy.max_attempts))
    assert waited > 120


def test_store_down_mid_job_then_back_loses_nothing(
    fleet_env, moto_server, make_workers, tmp_path, r
):
    proxy = TcpProxy(moto_server.port)
    bucket = f"outage-{uuid.uuid4().hex[:10]}"
    moto_server.client().create_bucket(Bucket=bucket)
    env = {
        **fleet_env,
        **AWS_ENV,
        "FLEET_STORE_URL": f"s3://{bucket}/runs",
        "FLEET_S3_ENDPOINT_URL": proxy.url,
    }
    (w,) = make_workers(
        [0],
        **{k: v for k, v in env.items() if k not in fleet_env or fleet_env[k] != v},
        FLEET_SIM_SPEED="4",
        FLEET_STORE_RETRY_MAX_S="2",
        FLEET_STORE_RETRY_ATTEMPTS="30",
    )
    src = write_prompts(tmp_path / "p.jsonl", 160)
    res = run_producer(env, "enqueue", str(src), "--job", "outage", "--batch-size", "20")
    assert res.returncode == 0, res.stderr
    deadline = time.monotonic() + 60
    while r.scard("fleet:job:outage:done") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    proxy.down()
    done_at_outage = r.scard("fleet:job:outage:done")
    time.sleep(12)
    # While the store is unreachable no batch can be marked done (results first, then ack)
    # nor start (its staged input is in the store): without the outage all 8 would be done.
    stuck = r.scard("fleet:job:outage:done")
    assert stuck <= done_at_outage + 1 and stuck < 8
    proxy.up()
    wait_done(env, "outage", timeout_s=240)
    report = orjson.loads(run_producer(env, "verify", "--job", "outage", "--json").stdout)
    assert report["ok"] and report["rows"] == 160 and report["duplicates"] == 0
    proxy.down()
