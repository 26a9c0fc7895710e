"""The fleet a schedule runs against, and the process tree its faults aim at.

One :class:`Cluster` per schedule: its own ``redis-server`` with an append-only file (so a
restart keeps what was written, as a production Redis would), a store (a local folder, or a
bucket of moto's server reached through :class:`tests.tcpproxy.TcpProxy` so it can be cut off),
GPU workers started with :func:`producer.localfleet.start_worker` and restarted by a small
supervisor when they die, and one sink worker (``celery -A workers worker -Q sink``).

Processes are found through ``/proc``: an engine is the simulator whose command line carries
``--port <its port>``, its guard the ``workers.engine.guard`` process with the same port, and a
pool child a child of the worker's main process (prefork children are forks: same argv).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from producer.localfleet import (
    RedisServer,
    WorkerProcess,
    free_port,
    start_redis,
    start_worker,
    stop_process,
    wait_healthy,
)
from tests.tcpproxy import TcpProxy
from workers.dataset.store import Store, open_store

if TYPE_CHECKING:
    from tests.s3fixture import MotoServer

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Proc:
    """One process as /proc shows it."""

    pid: int
    ppid: int
    argv: tuple[str, ...]


def processes() -> Iterator[Proc]:
    """Every process of this machine that can still be read."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = tuple(a.decode(errors="replace") for a in
                         (entry / "cmdline").read_bytes().split(b"\0") if a)
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        yield Proc(int(entry.name), ppid, argv)


def _module(p: Proc) -> str | None:
    """The module of ``python -m MODULE`` processes."""
    return p.argv[2] if len(p.argv) > 2 and p.argv[1] == "-m" else None


def _serves_port(p: Proc, port: int) -> bool:
    argv = list(p.argv)
    return any(a == "--port" and b == str(port) for a, b in zip(argv, argv[1:], strict=False))


def engine_procs(port: int) -> list[Proc]:
    """Simulator processes (not their guards) launched for ``port``."""
    return [p for p in processes() if _module(p) == "workers.sim" and _serves_port(p, port)]


def guard_procs(port: int) -> list[Proc]:
    """Engine guard processes of ``port``."""
    return [p for p in processes()
            if _module(p) == "workers.engine.guard" and _serves_port(p, port)]


def signal_pid(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid``; False if it is already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def signal_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process group led by ``pid``; False if it is gone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


class PortSquatter:
    """Holds a TCP port so nothing else can listen on it; connections are closed at once (a
    client sees a reset, as from an engine that is not there)."""

    def __init__(self, port: int) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # despite TIME_WAIT
        sock.bind(("127.0.0.1", port))  # OSError while someone listens there
        sock.listen(16)
        self._sock = sock
        threading.Thread(target=self._refuse, name=f"squat-{port}", daemon=True).start()

    def _refuse(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def close(self) -> None:
        """Let go of the port."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def port_outside_ephemeral_range(low: int = 20000) -> int:
    """A free port below the kernel's ephemeral range (never picked for outgoing sockets)."""
    first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(low, max(first, low + 1000))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


def sink_argv(node: str) -> list[str]:
    """Command line of a sink-only worker."""
    return [sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", "sink", "-n", node,
            "-c", "1", "-l", "INFO", "--without-mingle", "--without-gossip"]


@dataclass
class Cluster:
    """A running fleet of one schedule (see the module docstring)."""

    root: Path
    env: dict[str, str]
    redis_server: RedisServer
    gpus: list[int]
    moto: MotoServer | None = None
    proxy: TcpProxy | None = None
    restart_delay_s: float = 1.0
    workers: dict[int, WorkerProcess] = field(default_factory=dict)
    sink: subprocess.Popen[bytes] | None = None
    frozen: set[int] = field(default_factory=set)
    held_ports: dict[int, PortSquatter] = field(default_factory=dict)
    restarts: int = 0
    store_cut: bool = False
    _dead_since: dict[int, float] = field(default_factory=dict)

    # --- lifecycle -------------------------------------------------------------------
    @classmethod
    def start(cls, root: Path, base_env: dict[str, str], gpus: list[int],
              moto: MotoServer | None, worker_env: dict[str, str]) -> Cluster:
        """Start Redis (AOF), the store, ``gpus`` workers and a sink worker; wait until the
        engines are healthy."""
        server = start_redis(root / "redis", free_port(), aof=True)
        env = {**base_env, **worker_env, "FLEET_REDIS_URL": server.url,
               "FLEET_STORE_URL": (root / "store").as_uri(), "FLEET_LOG_DIR": str(root / "logs")}
        proxy = None
        if moto is not None:
            from tests.s3fixture import AWS_ENV

            bucket = f"chaos-{uuid.uuid4().hex[:12]}"
            moto.client().create_bucket(Bucket=bucket)
            proxy = TcpProxy(moto.port)
            # While the store is cut off the proxy's port is free; outside the ephemeral range
            # no outgoing connection of this machine can take it meanwhile.
            proxy.down()
            proxy.port = port_outside_ephemeral_range()
            proxy.up()
            env.update({**AWS_ENV, "FLEET_STORE_URL": f"s3://{bucket}/runs",
                        "FLEET_S3_ENDPOINT_URL": proxy.url})
            os.environ.update(AWS_ENV)  # moto's fake credentials, for this process's own reads
        cluster = cls(root=root, env=env, redis_server=server, gpus=gpus, moto=moto, proxy=proxy)
        try:
            for gpu in gpus:
                cluster.start_worker(gpu)
            cluster.start_sink()
            wait_healthy(cluster.client(), list(cluster.workers.values()), timeout_s=120)
        except BaseException:
            cluster.teardown()
            raise
        return cluster

    def client(self) -> redis.Redis:
        """A new client of the cluster's Redis (callers close it)."""
        return redis.Redis(host="127.0.0.1", port=self.redis_server.port, socket_timeout=10)

    def store(self) -> Store:
        """The store as the harness reads it: S3 straight from moto, never through the proxy,
        so checks work while the fleet's way to the store is cut."""
        from config.settings import S3Settings

        url = self.env["FLEET_STORE_URL"]
        endpoint = self.moto.url if self.moto is not None else None
        return open_store(url, S3Settings(endpoint_url=endpoint))

    def engine_port(self, gpu: int) -> int:
        """The port of the engine of ``gpu``."""
        return int(self.env["FLEET_ENGINE_BASE_PORT"]) + gpu

    def start_worker(self, gpu: int) -> WorkerProcess:
        """Start (or restart, under the same node name) the worker of ``gpu``."""
        w = start_worker(gpu, self.env, self.root / "logs", node=f"gpu{gpu}@chaos", cwd=ROOT)
        self.workers[gpu] = w
        return w

    def start_sink(self) -> None:
        """Start (or restart) the sink worker."""
        self.sink = subprocess.Popen(
            sink_argv("sink@chaos"), env=self.env, cwd=ROOT, start_new_session=True,
            stdout=(self.root / "logs" / "sink.log").open("ab"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)

    def supervise(self) -> list[int]:
        """Restart, as systemd's ``Restart=always`` would, the workers that died at least
        ``restart_delay_s`` ago (and a dead sink worker at once); return their GPUs."""
        if self.sink is not None and self.sink.poll() is not None:
            self.start_sink()
        now, restarted = time.monotonic(), []
        for gpu, w in self.workers.items():
            if w.proc.poll() is None or gpu in self.frozen:
                self._dead_since.pop(gpu, None)
                continue
            since = self._dead_since.setdefault(gpu, now)
            if now - since >= self.restart_delay_s:
                self._dead_since.pop(gpu)
                self.start_worker(gpu)
                self.restarts += 1
                restarted.append(gpu)
        return restarted

    def heal(self) -> None:
        """End every lasting fault except engines blocked for good: thaw, store back up."""
        for gpu in sorted(self.frozen):
            self.thaw(gpu)
        self.restore_store()

    def cut_store(self) -> bool:
        """Take the proxy to the store down; False if there is none or it is down already."""
        if self.proxy is None or self.store_cut:
            return False
        self.proxy.down()
        self.store_cut = True
        return True

    def restore_store(self) -> bool:
        """Bring the proxy to the store back; False if it was not down."""
        if self.proxy is None or not self.store_cut:
            return False
        deadline = time.monotonic() + 20
        while True:
            try:
                self.proxy.up()
                break
            except OSError:  # the port is taken for a moment: the outage lasts a bit longer
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.store_cut = False
        return True

    def thaw(self, gpu: int) -> None:
        """SIGCONT the worker's and its engine's process groups."""
        self.frozen.discard(gpu)
        signal_group(self.workers[gpu].proc.pid, signal.SIGCONT)
        for g in guard_procs(self.engine_port(gpu)):
            signal_group(g.pid, signal.SIGCONT)

    def release_port(self, gpu: int) -> None:
        """Let the engine of ``gpu`` bind its port again."""
        sock = self.held_ports.pop(gpu, None)
        if sock is not None:
            sock.close()

    def stop_workers(self, grace_s: float = 15.0) -> None:
        """Warm-stop every worker (SIGKILL of its group after ``grace_s``) and the sink."""
        self.heal()
        for w in self.workers.values():
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers.values():
            w.stop(grace_s=grace_s)
        sink, self.sink = self.sink, None  # no restart by the supervisor from here on
        if sink is not None:
            stop_process(sink, grace_s=grace_s)

    def engine_leftovers(self) -> list[Proc]:
        """Engines and guards of this cluster's ports still running."""
        found = []
        for gpu in self.gpus:
            port = self.engine_port(gpu)
            found += engine_procs(port) + guard_procs(port)
        return found

    def teardown(self) -> None:
        """Stop everything this cluster started (engines left over are killed by pid)."""
        self.stop_workers(grace_s=5)
        for p in self.engine_leftovers():
            signal_pid(p.pid, signal.SIGKILL)
        for gpu in list(self.held_ports):
            self.release_port(gpu)
        if self.proxy is not None and not self.store_cut:
            self.proxy.down()
        self.redis_server.stop()
