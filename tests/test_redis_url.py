"""Redis as the operator names it: a Unix socket works for the CLI, the clients and Celery's
broker; a worker that cannot reach Redis at start says so in one line and exits 4."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from config.settings import Settings, broker_url, redis_url
from producer.localfleet import free_port, worker_argv
from tests.conftest import ROOT, run_producer, write_prompts


@pytest.fixture()
def socket_redis(tmp_path: Path) -> Iterator[Path]:
    """A real redis-server listening on a Unix socket only."""
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock),
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    yield sock
    proc.terminate()
    proc.wait(timeout=10)


def test_a_unix_socket_url_keeps_its_three_slashes_and_becomes_kombus_spelling():
    assert redis_url("unix:///run/redis.sock") == "unix:///run/redis.sock"
    assert broker_url("unix:///run/redis.sock") == "redis+socket:///run/redis.sock"
    assert broker_url("redis://h:6379/0") == "redis://h:6379/0"


def test_a_unix_socket_redis_serves_the_cli_and_the_broker(socket_redis, fleet_env, tmp_path):
    url = f"unix://{socket_redis}"
    env = {**fleet_env, "FLEET_REDIS_URL": url}
    src = write_prompts(tmp_path / "p.jsonl", 6)
    res = run_producer(env, "enqueue", str(src), "--job", "sock", "--batch-size", "3")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    client = redis.Redis.from_url(Settings(redis_url=url).redis_url.get_secret_value())
    assert client.llen("gpu") == 2  # the batch messages went through kombu's socket transport
    res = run_producer(env, "status", "--job", "sock", "--json")
    assert res.returncode == 0, res.stderr


def test_a_worker_without_redis_prints_one_line_and_exits_4(fleet_env):
    env = {**fleet_env, "FLEET_REDIS_URL": f"redis://:pw-not-shown@127.0.0.1:{free_port()}/0",
           "FLEET_REDIS_STARTUP_WAIT_S": "1"}
    res = subprocess.run(worker_argv(0, "gpu0@noredis"), env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=90)
    assert res.returncode == 4, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if "refused" in x]
    assert len(lines) == 1 and "cannot reach Redis" in lines[0], res.stderr
    assert "Traceback" not in res.stderr and "pw-not-shown" not in res.stderr + res.stdout
