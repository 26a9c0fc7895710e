"""``make demo``: a small job through two simulated GPU workers, start to verified finish.

Starts its own Redis (Debian's ``redis-server`` on a free port) unless FLEET_REDIS_URL is
set: a demo never enqueues into whatever Redis answers at the default port, which on a shared
machine may be someone else's fleet. A FLEET_REDIS_URL that does not answer ends the demo with
one line (exit 4). Starts two workers (``celery -A workers worker -Q gpu0`` / ``gpu1``) whose
engines are the SGLang simulator, and Flower with the shipped config; enqueues a few hundred
prompts; shows the live status; runs ``verify``; waits for the data set the workers build when
the job ends (the README's path: no sink worker, no manual step); writes the report with plots;
prints where the results are. On a terminal, Flower and the workers stay up until Enter is
pressed; otherwise the demo stops everything it started at once and says so.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import redis
from rich.console import Console

from config.settings import load_settings
from producer.localfleet import (
    RedisServer,
    WorkerProcess,
    free_port,
    free_port_block,
    start_redis,
    start_worker,
    stop_process,
    stop_workers,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[1]
DEMO_DIR = ROOT / ".demo"
N_PROMPTS = 300
# The demo's job: the default quality gates and token caps (tests/test_quality_defaults.py
# holds it to passing verify with them).
ENQUEUE_ARGS = ("--batch-size", "50")
console = Console(highlight=False, soft_wrap=True)


class DemoRedisError(RuntimeError):
    """FLEET_REDIS_URL was set for the demo and nothing answers there."""


def _redis(explicit: str | None, folder: Path) -> tuple[str, RedisServer | None]:
    """The Redis the demo uses: the one FLEET_REDIS_URL names (``explicit``, which must
    answer), else a ``redis-server`` started in ``folder`` on a free port."""
    if explicit:
        where = explicit.split("@")[-1]  # never print a password
        try:
            redis.Redis.from_url(explicit, socket_connect_timeout=1).ping()
        except redis.RedisError as exc:
            raise DemoRedisError(f"FLEET_REDIS_URL is set ({where}) but Redis does not answer "
                                 f"there ({type(exc).__name__}); unset it to let the demo "
                                 "start its own") from None
        console.print(f"using the Redis FLEET_REDIS_URL names ({where})")
        return explicit, None
    server = start_redis(folder)
    console.print(f"started redis-server on 127.0.0.1:{server.port} for the demo (set "
                  "FLEET_REDIS_URL to use another)")
    return server.url, server


def _prompts(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        for i in range(N_PROMPTS):
            row = {"id": f"demo-{i}",
                   "messages": [{"role": "user", "content": f"Explain idea number {i} briefly."}]}
            fh.write(orjson.dumps(row) + b"\n")
    return path


def _flower(env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    """Flower with the shipped config on 127.0.0.1 (no credentials needed there)."""
    log = DEMO_DIR / "logs" / "flower.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers", "flower", "--address=127.0.0.1",
         f"--port={port}", "--conf=deploy/flowerconfig.py"],
        env=env, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT,
        start_new_session=True)


def _producer(env: dict[str, str], *args: str) -> int:
    console.print(f"$ python -m producer {' '.join(args)}", style="bold")
    return subprocess.call([sys.executable, "-m", "producer", *args], env=env, cwd=ROOT)


def main() -> int:
    """Run the demo; returns the exit code of ``verify``."""
    settings = load_settings()
    # Only a FLEET_REDIS_URL in the environment counts, not the settings' default URL.
    explicit = settings.redis_url.get_secret_value() if os.environ.get("FLEET_REDIS_URL") \
        else None
    try:
        url, server = _redis(explicit, DEMO_DIR / "redis")
    except DemoRedisError as exc:
        Console(stderr=True, highlight=False).print(f"error: {exc}", soft_wrap=True)
        return 4
    env = {**os.environ, "FLEET_REDIS_URL": url, "FLEET_ENGINE": "sim",
           "FLEET_ENGINE_BASE_PORT": str(free_port_block(8)),
           "FLEET_METRICS_BASE_PORT": str(free_port_block(8)),
           "FLEET_SIM_SPEED": os.environ.get("FLEET_SIM_SPEED", "5"),
           "FLEET_SIM_STARTUP_S": "0.5", "FLEET_LOG_DIR": str(DEMO_DIR / "logs"),
           "FLEET_ALLOW_NODE_LOCAL_STORE": "1",  # the demo's store is a local folder
           "PYTHONPATH": str(ROOT)}
    job = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    workers: list[WorkerProcess] = []
    flower_port = free_port()
    flower = _flower(env, flower_port)
    try:
        for gpu in (0, 1):
            workers.append(start_worker(gpu, env, DEMO_DIR / "logs",
                                        node=f"gpu{gpu}@{socket.gethostname()}-demo", cwd=ROOT))
        console.print("started 2 GPU workers (simulated engines); waiting for health ...")
        console.print(f"Flower: http://127.0.0.1:{flower_port}  Prometheus metrics: "
                      f"http://127.0.0.1:{env['FLEET_METRICS_BASE_PORT']}/metrics (GPU 0), "
                      "+1 for GPU 1")
        wait_healthy(redis.Redis.from_url(url), workers, timeout_s=120)
        prompts = _prompts(DEMO_DIR / "prompts.jsonl")
        _producer(env, "enqueue", str(prompts), "--job", job, *ENQUEUE_ARGS)
        _producer(env, "status", "--job", job, "--watch", "--interval", "1")
        code = _producer(env, "verify", "--job", job)
        # The workers built the data set when the job ended (they consume the sink queue).
        dataset = _wait_dataset(redis.Redis.from_url(url), job, timeout_s=120)
        console.print(f"data set of job {job}: {dataset or 'not built within 120 s'}")
        code = code or (0 if dataset and dataset.startswith("committed") else 1)
        code = code or _producer(env, "dataset-path", "--job", job)
        _producer(env, "report", "--job", job, "--out", str(DEMO_DIR / "report"))
        store = env.get("FLEET_STORE_URL", settings.store_url)
        console.print(f"per-batch results under {store}/jobs/{job}/results/; report in "
                      f"{DEMO_DIR / 'report'}; logs in {DEMO_DIR / 'logs'}")
        console.print(_quality_line(redis.Redis.from_url(url), job), style="bold")
        _hold(f"http://127.0.0.1:{flower_port}")
        return code
    finally:
        stop_process(flower, grace_s=5)
        stop_workers(workers, grace_s=20)
        if server:
            server.stop()
        console.print("stopped every process the demo started (Flower, the workers"
                      + (", redis-server)" if server else ")"))


def _wait_dataset(r: redis.Redis, job: str, timeout_s: float) -> str | None:
    """The job's data-set state once it is committed (None if not within ``timeout_s``)."""
    from workers.delivery.job_progress import dataset_state
    from workers.redisdb.keys import JobKeys

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state, _ = dataset_state(r.hgetall(JobKeys(job).sink))
        if state and state != "building":
            return state
        time.sleep(0.5)
    return None


def _quality_line(r: redis.Redis, job: str) -> str:
    """The demo's last word: the committed data set's quality verdict."""
    from workers.delivery.job_progress import quality_failed
    from workers.redisdb.keys import JobKeys

    failed = quality_failed(r.hgetall(JobKeys(job).sink))
    if failed is None:
        return f"quality of job {job}: no data set committed"
    if not failed:
        return f"quality of job {job}: ok (every gate passed; fleet verify --job {job} --json)"
    return (f"quality of job {job}: {len(failed)} gate(s) failed: {', '.join(failed)} "
            f"(fleet verify --job {job})")


def _hold(flower_url: str) -> None:
    """On a terminal, keep Flower and the workers up until Enter (or Ctrl-C)."""
    if not sys.stdin.isatty():
        return
    console.print(f"Flower stays up at {flower_url} with the workers: press Enter (or Ctrl-C) "
                  "to stop them", style="bold")
    try:
        input()
    except (EOFError, KeyboardInterrupt):
        pass


if __name__ == "__main__":
    sys.exit(main())
