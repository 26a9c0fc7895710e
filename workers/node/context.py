"""Who this worker is: its node name, GPU group and engine port (set once in the main process).

The main process fills this in at ``worker_init`` (before the prefork pool forks), so pool
children inherit it; a task never has to guess its GPUs. Which GPUs a queue name means is
decided by :mod:`workers.node.gpu_group` alone.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from workers.errors import FleetError
from workers.node.gpu_group import GpuGroup


@dataclass(frozen=True)
class WorkerIdentity:
    """One GPU worker: one GPU or a group of them, and one engine."""

    node: str  # Celery node name, e.g. gpu0@host or gpu0-1@host
    host: str
    gpu: int  # the group's first GPU
    port: int
    gpus: tuple[int, ...] = ()  # every GPU of the group; () means (gpu,)
    queue: str = ""  # the GPU queue it consumes; "" means gpu<gpu>

    @property
    def group(self) -> GpuGroup:
        """The worker's GPU group."""
        return GpuGroup(self.gpus or (self.gpu,))

    @property
    def gpu_queue(self) -> str:
        """The GPU queue this worker consumes (``gpu3``, ``gpu0-1``)."""
        return self.queue or self.group.name


_identity: WorkerIdentity | None = None


def set_identity(node: str, group: GpuGroup, port: int, queue: str = "") -> WorkerIdentity:
    """Record this worker's identity (main process, before the pool starts)."""
    global _identity
    _identity = WorkerIdentity(node=node, host=socket.gethostname(), gpu=group.first, port=port,
                               gpus=group.gpus, queue=queue or group.name)
    return _identity


def identity() -> WorkerIdentity:
    """This worker's identity; FleetError outside a fleet worker."""
    if _identity is None:
        raise FleetError("not running inside a fleet GPU worker (no identity set)")
    return _identity
