"""Start and stop a fleet on this machine: redis-server and GPU workers as real processes.

Used by ``make demo`` (``python -m producer.demo``) and by the test suite, so both run the
same commands a user would: ``redis-server`` (Debian's binary) and
``celery -A workers worker -Q gpuN``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low(default: int = 32768) -> int:
    """The first port the kernel hands out to outgoing connections (Linux's
    ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


# Blocks this process has handed out: none is bound until its servers start, so a second draw
# could otherwise return the same free block (a test's engine and metrics ports once did; the
# worker's health probe then reached its own metrics exporter).
_HANDED_OUT: list[range] = []


def free_port_block(n: int) -> int:
    """First port of ``n`` consecutive free ports (for engine ports base+0 .. base+n-1), never
    overlapping a block this process handed out before.

    Drawn below the kernel's ephemeral range: a port free when it is checked there can be
    given to any process's outgoing connection before the engine binds it (a test engine
    once failed to start with "address already in use" on port 49010)."""
    import random

    top = max(_ephemeral_low() - n, 12000)
    for _ in range(200):
        base = random.randrange(10000, top, 10)
        block = range(base, base + n)
        if any(block.start < b.stop and b.start < block.stop for b in _HANDED_OUT):
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            _HANDED_OUT.append(block)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports found")


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 15.0,
                 sig: int = signal.SIGTERM) -> None:
    """Signal the process (its own children are its business), wait, then SIGKILL its group."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(sig)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


@dataclass
class RedisServer:
    """A redis-server process bound to 127.0.0.1."""

    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        """redis:// URL of database 0."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A client of database 0."""
        return redis.Redis(host="127.0.0.1", port=self.port)

    def stop(self) -> None:
        """Shut the server down."""
        stop_process(self.proc, grace_s=5)


def start_redis(workdir: Path, port: int | None = None, aof: bool = False) -> RedisServer:
    """Start ``redis-server`` on a free port and wait until it answers. Nothing is persisted,
    unless ``aof``: then ``appendonly yes`` (fsync every second), so a restart on the same
    port and folder reloads what it held."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found: apt-get install redis-server")
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         *(["--appendonly", "yes", "--appendfsync", "everysec"] if aof else
           ["--appendonly", "no"]),
         "--dir", str(workdir), "--maxmemory-policy", "noeviction"],
        stdout=(workdir / f"redis-{port}.log").open("ab"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = RedisServer(port=port, proc=proc)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if server.client().ping():
                return server
        except (redis.ConnectionError, redis.ResponseError):  # ResponseError: still loading
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"redis-server did not answer on port {port}")


@dataclass
class WorkerProcess:
    """One ``celery -A workers worker -Q gpuN`` process."""

    gpu: int
    node: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str] = field(repr=False, default_factory=dict)

    def stop(self, grace_s: float = 30.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL after the grace period."""
        stop_process(self.proc, grace_s=grace_s)

    def kill(self) -> None:
        """SIGKILL the worker's main process only (as the OOM killer would)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


def stop_workers(workers: list[WorkerProcess], grace_s: float = 30.0) -> None:
    """Warm-stop every worker at once: each one's shutdown (its engine's grace included) runs
    beside the others' instead of after them."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        w.stop(grace_s=grace_s)


def worker_argv(gpu: int, node: str, loglevel: str = "INFO") -> list[str]:
    """The command line of one GPU worker."""
    return [sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", f"gpu{gpu}",
            "-n", node, "-l", loglevel, "--without-mingle", "--without-gossip"]


def start_worker(gpu: int, env: dict[str, str], log_dir: Path, node: str | None = None,
                 cwd: Path | None = None) -> WorkerProcess:
    """Start a GPU worker in its own process group, logging to ``log_dir``."""
    node = node or f"gpu{gpu}@{socket.gethostname()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"worker-gpu{gpu}.log"
    proc = subprocess.Popen(
        worker_argv(gpu, node), env=env, cwd=cwd, stdout=log_path.open("ab"),
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    return WorkerProcess(gpu=gpu, node=node, proc=proc, log_path=log_path, env=env)


def wait_healthy(r: redis.Redis, workers: list[WorkerProcess], timeout_s: float = 120) -> None:
    """Wait until every worker's heartbeat says its engine is healthy."""
    from workers.node.heartbeat import read_heartbeats

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for w in workers:
            if w.proc.poll() is not None:
                raise RuntimeError(f"worker {w.node} exited; see {w.log_path}")
        states = {b["node"]: b["engine_state"] for b in read_heartbeats(r)}
        if all(states.get(w.node) == "healthy" for w in workers):
            return
        time.sleep(0.2)
    raise RuntimeError(f"workers not healthy after {timeout_s:.0f} s: {states}")
