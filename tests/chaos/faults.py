"""Faults a schedule injects: each takes the cluster and its step's arguments, acts at once and
returns one line saying what it did (``skipped: …`` when its target is not there right now).

A lasting fault is two steps the schedule pairs (freeze/thaw, block/unblock, store down/up),
so a schedule printed from its seed shows when each one ends.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from producer.localfleet import start_redis
from tests.chaos.cluster import (
    Cluster,
    PortSquatter,
    engine_procs,
    guard_procs,
    processes,
    signal_group,
    signal_pid,
)

QUEUE_PATTERN = "gpu*"  # the shared queue gpu, pinned gpuN, and kombu's priority variants


def kill_worker(c: Cluster, gpu: int) -> str:
    """SIGKILL a worker's main process (the OOM killer); the supervisor restarts it."""
    w = c.workers[gpu]
    if w.proc.poll() is not None:
        return f"skipped: worker gpu{gpu} already dead"
    w.kill()
    return f"SIGKILL worker gpu{gpu} (pid {w.proc.pid})"


def kill_pool_child(c: Cluster, gpu: int, pick: int) -> str:
    """SIGKILL one prefork child of a worker (a batch's process dies under it)."""
    main = c.workers[gpu].proc.pid
    children = sorted(p.pid for p in processes()
                      if p.ppid == main and "workers.engine.guard" not in p.argv)
    if not children:
        return f"skipped: worker gpu{gpu} has no pool child"
    pid = children[pick % len(children)]
    signal_pid(pid, signal.SIGKILL)
    return f"SIGKILL pool child {pid} of worker gpu{gpu}"


def kill_engine(c: Cluster, gpu: int, target: str) -> str:
    """SIGKILL the engine of a GPU: the simulator itself, or its guard process."""
    port = c.engine_port(gpu)
    procs = engine_procs(port) if target == "engine" else guard_procs(port)
    if not procs:
        return f"skipped: no {target} process for gpu{gpu}"
    for p in procs:
        signal_pid(p.pid, signal.SIGKILL)
    return f"SIGKILL {target} of gpu{gpu} (pids {[p.pid for p in procs]})"


def freeze_worker(c: Cluster, gpu: int, with_engine: bool) -> str:
    """SIGSTOP a worker's process group (and its engine's: a frozen VM) until thawed."""
    w = c.workers[gpu]
    if w.proc.poll() is not None:
        return f"skipped: worker gpu{gpu} is dead"
    c.frozen.add(gpu)
    signal_group(w.proc.pid, signal.SIGSTOP)
    if with_engine:
        for g in guard_procs(c.engine_port(gpu)):
            signal_group(g.pid, signal.SIGSTOP)
    return f"SIGSTOP worker gpu{gpu}" + (" and its engine" if with_engine else "")


def thaw_worker(c: Cluster, gpu: int) -> str:
    """SIGCONT what :func:`freeze_worker` stopped."""
    if gpu not in c.frozen:
        return f"skipped: gpu{gpu} not frozen"
    c.thaw(gpu)
    return f"SIGCONT worker gpu{gpu}"


def block_engine(c: Cluster, gpu: int, timeout_s: float = 10.0) -> str:
    """Kill a GPU's engine and hold its port, so every restart fails until unblocked."""
    if gpu in c.held_ports:
        return f"skipped: gpu{gpu} already blocked"
    port = c.engine_port(gpu)
    for p in engine_procs(port):
        signal_pid(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            c.held_ports[gpu] = PortSquatter(port)
        except OSError:
            for p in engine_procs(port):  # a restart beat us to it: kill it again
                signal_pid(p.pid, signal.SIGKILL)
            time.sleep(0.05)
            continue
        return f"engine of gpu{gpu} killed and its port {port} held: restarts fail"
    return f"skipped: port {port} of gpu{gpu} never came free"


def unblock_engine(c: Cluster, gpu: int) -> str:
    """Release the port :func:`block_engine` holds: the next restart succeeds."""
    if gpu not in c.held_ports:
        return f"skipped: gpu{gpu} not blocked"
    c.release_port(gpu)
    return f"port of gpu{gpu} released: its engine can start again"


def restart_redis(c: Cluster, hard: bool) -> str:
    """Restart Redis on the same port; it reloads its append-only file (SIGKILL or SIGTERM)."""
    server = c.redis_server
    if hard:
        signal_group(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
    else:
        server.stop()
    c.redis_server = start_redis(c.root / "redis", server.port, aof=True)
    return f"Redis {'SIGKILLed' if hard else 'shut down'} and restarted from its AOF"


def lose_queues(c: Cluster) -> str:
    """DEL every queue list (a failover to a replica that missed them)."""
    client = c.client()
    try:
        names = list(client.scan_iter(match=QUEUE_PATTERN, _type="LIST"))
        lengths = [client.llen(n) for n in names]
        if names:
            client.delete(*names)
    finally:
        client.close()
    shown = [n.decode(errors="replace") for n in names]
    return f"DEL queue lists {shown} ({sum(lengths)} messages)"


def store_down(c: Cluster) -> str:
    """Cut the fleet off from the store (the proxy refuses and drops every connection)."""
    if not c.cut_store():
        return "skipped: local store or already cut off"
    return "store cut off"


def store_up(c: Cluster) -> str:
    """Let the fleet reach the store again."""
    if not c.restore_store():
        return "skipped: the store was not cut off"
    return "store reachable again"


FAULTS: dict[str, Callable[..., str]] = {
    "kill_worker": kill_worker,
    "kill_pool_child": kill_pool_child,
    "kill_engine": kill_engine,
    "freeze_worker": freeze_worker,
    "thaw_worker": thaw_worker,
    "block_engine": block_engine,
    "unblock_engine": unblock_engine,
    "restart_redis": restart_redis,
    "lose_queues": lose_queues,
    "store_down": store_down,
    "store_up": store_up,
}
