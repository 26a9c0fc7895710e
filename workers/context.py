"""Who this worker is: its node name, GPU and engine port (set once in the main process).

The main process fills this in at ``worker_init`` (before the prefork pool forks), so pool
children inherit it; a task never has to guess its GPU.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from workers.errors import FleetError

_GPU_QUEUE = re.compile(r"gpu(\d+)")  # matched in full: not "gpu0\n"


@dataclass(frozen=True)
class WorkerIdentity:
    """One GPU worker."""

    node: str  # Celery node name, e.g. gpu0@host
    host: str
    gpu: int
    port: int


_identity: WorkerIdentity | None = None


def gpu_from_queues(queues: Iterable[str], override: int | None) -> int:
    """GPU index from ``FLEET_GPU`` or the single ``gpuN`` queue the worker consumes."""
    if override is not None:
        return override
    found = sorted({int(m.group(1)) for q in queues if (m := _GPU_QUEUE.fullmatch(q))})
    if len(found) != 1:
        raise FleetError(
            f"cannot tell the GPU from queues {sorted(queues)}: consume exactly one gpuN queue "
            "(celery -A workers worker -Q gpu0) or set FLEET_GPU"
        )
    return found[0]


def set_identity(node: str, gpu: int, port: int) -> WorkerIdentity:
    """Record this worker's identity (main process, before the pool starts)."""
    global _identity
    _identity = WorkerIdentity(node=node, host=socket.gethostname(), gpu=gpu, port=port)
    return _identity


def identity() -> WorkerIdentity:
    """This worker's identity; FleetError outside a fleet worker."""
    if _identity is None:
        raise FleetError("not running inside a fleet GPU worker (no identity set)")
    return _identity
