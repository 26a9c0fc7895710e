"""Shared fixtures: a real redis-server and moto's S3 server once per session, real worker
processes per test.

Under pytest-xdist (``make test`` runs ``-n``) a session is one xdist worker: each worker
starts its own redis-server and moto server once, so tests of two workers never share a
Redis database or a bucket namespace.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest
import redis

from producer.localfleet import (
    RedisServer,
    WorkerProcess,
    free_port_block,
    start_redis,
    start_worker,
    stop_workers,
    wait_healthy,
)
from workers.dataset.quality_gates import GATES

ROOT = Path(__file__).resolve().parents[1]

# moto_server and s3_env, for every test module.
pytest_plugins = ["tests.s3fixture"]


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker sets COLUMNS=80 and LINES=24 in its environment; commands the tests
    run would inherit them and cut their tables at 80 columns, as no user's pipe does."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for name in ("COLUMNS", "LINES"):
            os.environ.pop(name, None)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free port for the whole session (fails, never skips)."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture()
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the session's Redis, flushed before each test."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture()
def fleet_env(redis_server: RedisServer, tmp_path: Path) -> dict[str, str]:
    """Environment for producer and workers of one test: own store, ports and logs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({
        "FLEET_REDIS_URL": redis_server.url,
        "FLEET_STORE_URL": (tmp_path / "store").as_uri(),
        "FLEET_ALLOW_NODE_LOCAL_STORE": "1",  # a folder store (workers/dataset/location.py)
        "FLEET_ENGINE": "sim",
        "FLEET_PROFILE": "qwen36-27b",
        "FLEET_ENGINE_BASE_PORT": str(free_port_block(8)),
        "FLEET_METRICS_BASE_PORT": str(free_port_block(8)),
        "FLEET_LOG_DIR": str(tmp_path / "logs"),
        "FLEET_SIM_SPEED": "10",
        "FLEET_SIM_MEAN_OUTPUT_TOKENS": "40",
        "FLEET_SIM_STARTUP_S": "0.2",
        "FLEET_SIM_SEED": "7",
        # The sim's answers here are ~40 tokens and jobs cap them low: every quality gate is
        # off unless a test sets its own (tests/test_quality*.py).
        "FLEET_QUALITY": ",".join(f"{g}=1" for g in GATES),
        "FLEET_ENGINE_HEALTH_INTERVAL_S": "0.5",
        "FLEET_HEARTBEAT_INTERVAL_S": "1",
        "PYTHONPATH": str(ROOT),
    })
    return env


@pytest.fixture()
def make_workers(fleet_env: dict[str, str], tmp_path: Path, r: redis.Redis
                 ) -> Iterator[Callable[..., list[WorkerProcess]]]:
    """Factory: start GPU workers (real celery processes), wait for healthy engines."""
    started: list[WorkerProcess] = []

    def make(gpus: list[int], wait: bool = True, **env: str) -> list[WorkerProcess]:
        ws = [start_worker(g, {**fleet_env, **env}, tmp_path / "logs",
                           node=f"gpu{g}@test{len(started) + i}", cwd=ROOT)
              for i, g in enumerate(gpus)]
        started.extend(ws)
        if wait:
            wait_healthy(r, ws, timeout_s=90)
        return ws

    yield make
    stop_workers(started, grace_s=20)


def run_producer(env: dict[str, str], *args: str, timeout_s: float = 120
                 ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m producer ARGS`` as a user would."""
    return subprocess.run([sys.executable, "-m", "producer", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


def run_tune(env: dict[str, str], *args: str, timeout_s: float = 240
             ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m workers.tune ARGS`` as a user would."""
    return subprocess.run([sys.executable, "-m", "workers.tune", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


def write_prompts(path: Path, n: int, start: int = 0) -> Path:
    """A JSONL prompt file with ``n`` rows (plain prompts and chat messages mixed)."""
    with path.open("wb") as fh:
        for i in range(start, start + n):
            row = ({"id": f"p{i}", "prompt": f"Question {i}: why is the sky blue?"} if i % 2
                   else {"id": f"p{i}", "messages": [{"role": "user", "content": f"Hi {i}"}]})
            fh.write(orjson.dumps(row) + b"\n")
    return path


def status_watch_argv(job: str, interval_s: float) -> list[str]:
    """``python -m producer status --watch --json``: one JSON line per tick until done."""
    return [sys.executable, "-m", "producer", "status", "--job", job, "--watch", "--json",
            "--interval", str(interval_s)]


def follow_status(env: dict[str, str], job: str, until: Callable[[dict], bool],
                  timeout_s: float = 180, what: str = "the awaited status") -> dict:
    """Follow ``status --watch --json`` (a line every 0.5 s) until ``until`` holds for a line;
    return that status. Raises AssertionError with the last status when the time runs out or
    the watch ends (the job done) first.

    One process for the whole wait: a ``status`` process per poll costs ~0.7 s of CPU, over
    half a core while a test waits, on a 2-core machine that runs four tests at once."""
    proc = subprocess.Popen(status_watch_argv(job, 0.5), env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    deadline, last = time.monotonic() + timeout_s, None
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"job {job}: no {what} after {timeout_s} s: {last}"
                                     ) from None
            if line is None:
                stderr = proc.stderr.read() if proc.stderr else ""
                raise AssertionError(f"job {job}: status --watch ended (rc {proc.wait()}) "
                                     f"before {what}: {last} {stderr}")
            last = orjson.loads(line)
            if until(last):
                return last
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def wait_done(env: dict[str, str], job: str, timeout_s: float = 180) -> dict:
    """Follow ``status`` until the job is done; return its last status."""
    return follow_status(env, job, lambda st: st["done"], timeout_s, "done")
