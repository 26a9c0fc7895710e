"""``make demo``: a small job through two simulated GPU workers, start to verified finish.

Uses the Redis at FLEET_REDIS_URL when one answers, otherwise starts Debian's ``redis-server``
on a free port; starts two workers (``celery -A workers worker -Q gpu0`` / ``gpu1``) whose
engines are the SGLang simulator, and Flower with the shipped config; enqueues a few hundred
prompts; shows the live status; runs ``verify``; writes the report with plots; prints where the
results are; stops everything it started.
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
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[1]
DEMO_DIR = ROOT / ".demo"
N_PROMPTS = 300
console = Console(highlight=False)


def _redis(url: str) -> tuple[str, RedisServer | None]:
    try:
        if redis.Redis.from_url(url, socket_connect_timeout=1).ping():
            console.print(f"using the Redis that answers at {url.split('@')[-1]}")
            return url, None
    except redis.RedisError:
        pass
    server = start_redis(DEMO_DIR / "redis")
    console.print(f"no Redis reachable: started redis-server on 127.0.0.1:{server.port}")
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
         f"--port={port}", "--conf=config/flowerconfig.py"],
        env=env, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT,
        start_new_session=True)


def _producer(env: dict[str, str], *args: str) -> int:
    console.print(f"$ python -m producer {' '.join(args)}", style="bold")
    return subprocess.call([sys.executable, "-m", "producer", *args], env=env, cwd=ROOT)


def main() -> int:
    """Run the demo; returns the exit code of ``verify``."""
    settings = load_settings()
    url, server = _redis(settings.redis_url.get_secret_value())
    env = {**os.environ, "FLEET_REDIS_URL": url, "FLEET_ENGINE": "sim", "FLEET_SINK_AUTO": "false",
           "FLEET_ENGINE_BASE_PORT": str(free_port_block(8)),
           "FLEET_METRICS_BASE_PORT": str(free_port_block(8)),
           "FLEET_SIM_SPEED": os.environ.get("FLEET_SIM_SPEED", "5"),
           "FLEET_SIM_MEAN_OUTPUT_TOKENS": os.environ.get("FLEET_SIM_MEAN_OUTPUT_TOKENS", "300"),
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
        _producer(env, "enqueue", str(prompts), "--job", job, "--batch-size", "50",
                  "--max-new-tokens", "2048")
        _producer(env, "status", "--job", job, "--watch", "--interval", "1")
        code = _producer(env, "verify", "--job", job)
        # Aggregate into the Parquet data set (here in-process; a fleet runs a sink worker).
        code = code or _producer(env, "sink", "--job", job, "--local")
        _producer(env, "report", "--job", job, "--out", str(DEMO_DIR / "report"))
        store = env.get("FLEET_STORE_URL", settings.store_url)
        console.print(f"data set: python -m producer dataset-path --job {job} (manifest.json "
                      f"names it); per-batch results under {store}/jobs/{job}/results/")
        console.print(f"logs: {DEMO_DIR / 'logs'}")
        return code
    finally:
        stop_process(flower, grace_s=5)
        for w in workers:
            w.stop(grace_s=20)
        if server:
            server.stop()
        console.print("stopped every process the demo started")


if __name__ == "__main__":
    sys.exit(main())
