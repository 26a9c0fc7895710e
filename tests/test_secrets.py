"""Secrets: a Redis password with URL characters works and never reaches a log; the engine
inherits none of the worker's secrets; placeholder secrets are refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from pydantic import ValidationError

from config.settings import Settings
from deploy import preflight
from producer.localfleet import free_port, start_worker, stop_process, wait_healthy
from tests.conftest import ROOT
from workers.engine.lifecycle import engine_base_env
from workers.node.heartbeat import read_heartbeats

PASSWORD = "p/w#fr4g?q=1@h0st%41"
FRAGMENTS = ("fr4g", "q=1", "h0st", "%41", "p/w")


@pytest.fixture()
def locked_redis(tmp_path: Path):
    """A redis-server that needs PASSWORD."""
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
         "--requirepass", PASSWORD], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, password=PASSWORD)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield port, client
    stop_process(proc, grace_s=5)


def _health(env: dict[str, str], node: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deploy.healthcheck", "heartbeat", node],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_redis_password_with_url_characters_works_and_stays_out_of_logs_and_engine(
        fleet_env, locked_redis, tmp_path):
    port, client = locked_redis
    env = {**fleet_env, "FLEET_REDIS_URL": f"redis://127.0.0.1:{port}/0",
           "REDIS_PASSWORD": PASSWORD, "AWS_ACCESS_KEY_ID": "AKIAFLEETTEST",
           "AWS_SECRET_ACCESS_KEY": "aws-secret-for-test", "HF_TOKEN": "hf_token_for_test"}
    w = start_worker(0, env, tmp_path / "logs", node="gpu0@secrets", cwd=ROOT)
    try:
        wait_healthy(client, [w], timeout_s=90)
        assert _health(env, w.node).returncode == 0
        wrong = _health({**env, "REDIS_PASSWORD": "wrong/pass#word?x"}, w.node)
        assert wrong.returncode == 1 and "wrong" not in wrong.stdout + wrong.stderr
        beat = next(b for b in read_heartbeats(client) if b["node"] == w.node)
        engine_env = dict(item.split("=", 1) for item in
                          Path(f"/proc/{beat['engine_pid']}/environ").read_text().split("\0")
                          if "=" in item)
    finally:
        w.stop(grace_s=20)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "REDIS_PASSWORD",
                 "FLEET_REDIS_URL", "FLEET_STORE_URL"):
        assert name not in engine_env, name
    assert engine_env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "FLEET_SIM_SPEED" in engine_env and "FLEET_SIM_MEAN_OUTPUT_TOKENS" in engine_env
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").rglob("*.log"))
    assert "celery@" in logs or "ready" in logs  # the worker did log
    for fragment in FRAGMENTS:
        assert fragment not in logs, fragment


def test_engine_environment_keeps_what_the_engine_needs_only():
    env = engine_base_env({"PATH": "/bin", "HOME": "/root", "CUDA_HOME": "/cuda",
                           "SGLANG_ENABLE_SPEC_V2": "1", "HF_HOME": "/hf", "HF_TOKEN": "t",
                           "AWS_SECRET_ACCESS_KEY": "s", "FLEET_REDIS_URL": "redis://x",
                           "REDIS_PASSWORD": "p", "FLEET_SIM_SPEED": "3",
                           "FLEET_SIM_MEAN_OUTPUT_TOKENS": "40", "HF_HUB_TOKEN": "t",
                           "TRITON_CACHE_DIR": "/c"})
    assert env == {"PATH": "/bin", "HOME": "/root", "CUDA_HOME": "/cuda",
                   "SGLANG_ENABLE_SPEC_V2": "1", "HF_HOME": "/hf", "FLEET_SIM_SPEED": "3",
                   "FLEET_SIM_MEAN_OUTPUT_TOKENS": "40", "TRITON_CACHE_DIR": "/c"}


def test_placeholder_secrets_are_refused_naming_the_variable_only():
    env = {"REDIS_PASSWORD": "change-me", "FLOWER_PASSWORD": "Change-Me",
           "GRAFANA_PASSWORD": "", "AWS_ACCESS_KEY_ID": "fleetkey",
           "AWS_SECRET_ACCESS_KEY": "change-me"}
    found = preflight.problems(env, list(preflight.SECRETS))
    assert [line.split()[0] for line in found] == [
        "REDIS_PASSWORD", "FLOWER_PASSWORD", "GRAFANA_PASSWORD", "AWS_SECRET_ACCESS_KEY"]
    res = subprocess.run([sys.executable, "-m", "deploy.preflight", "redis"], cwd=ROOT,
                         env={**os.environ, **env}, capture_output=True, text=True)
    assert res.returncode == 1 and "REDIS_PASSWORD" in res.stderr
    assert "Traceback" not in res.stderr
    ok = {k: "a-real-secret-1f2e3d" for k in env}
    assert preflight.problems(ok, list(preflight.SECRETS)) == []
    for url, password in (("redis://:change-me@h:6379/0", None),
                          ("redis://h:6379/0", "change-me")):
        with pytest.raises(ValidationError, match="placeholder") as info:
            Settings(redis_url=url, redis_password=password)
        assert "input_value" not in str(info.value)
