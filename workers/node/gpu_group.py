"""GPU groups: the GPUs a worker owns, read from its queue name by the one parser the fleet has.

A worker's queue names its GPUs: ``gpuN`` (one GPU), ``gpuA-B`` (the range A..B, A < B) or
``gpuA+B+...`` (a list). ``gpu`` alone is the shared queue. Any other name that starts with
``gpu`` is refused: a name the parser cannot read never falls back to some other GPU.
``FLEET_GPU`` may spell a group the same way (``2``, ``0-1``, ``gpu0+1``); when the queues name
a group too, both must agree.

Ownership: a worker claims every GPU of its group in Redis, all or none in one script, as its
Celery node name (``gpu0-1@host``), under the host part of that name (``%h``: the machine, or
``NODE_NAME`` in a container). The claims expire unless the heartbeat renews them, so a
worker that died frees its GPUs on its own; a worker restarted under the same node name takes
its own claims back at once. A second live worker of the same host that names one of those
GPUs is refused with one line naming its queue, the GPU and the owner.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis

from workers.errors import FleetError
from workers.node.queues import SHARED_QUEUE
from workers.redisdb import scripts

_SINGLE = re.compile(r"(\d+)")
_RANGE = re.compile(r"(\d+)-(\d+)")
_LIST = re.compile(r"\d+(?:\+\d+)+")
SPELLINGS = "gpuN, gpuA-B (a range) or gpuA+B (a list)"
# A claim outlives a few missed heartbeats (renewed at every beat, see workers/wiring/runtime.py).
CLAIM_MIN_TTL_S = 30.0


class GroupError(FleetError):
    """A worker's queue names no GPU, or a GPU that another live worker owns."""


@dataclass(frozen=True)
class GpuGroup:
    """The GPUs one worker and its engine own, in PCI bus order (as NVML numbers them)."""

    gpus: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.gpus or list(self.gpus) != sorted(set(self.gpus)):
            raise GroupError(f"a GPU group lists distinct GPUs in order, not {self.gpus}")

    @property
    def first(self) -> int:
        """The group's first GPU: its engine port, metrics port and ``gpu`` field."""
        return self.gpus[0]

    @property
    def size(self) -> int:
        """How many GPUs the group has (the engine's tp-size unless the profile sets one)."""
        return len(self.gpus)

    @property
    def label(self) -> str:
        """``3``, ``0-1`` (a contiguous range) or ``0+2`` (a list): the ``gpu`` label of
        metrics, Flower and ``status``."""
        if self.size == 1:
            return str(self.first)
        if self.gpus == tuple(range(self.first, self.gpus[-1] + 1)):
            return f"{self.first}-{self.gpus[-1]}"
        return "+".join(map(str, self.gpus))

    @property
    def name(self) -> str:
        """The group's canonical queue name (``gpu3``, ``gpu0-1``, ``gpu0+2``)."""
        return f"gpu{self.label}"

    @property
    def service_name(self) -> str:
        """The name as a Compose service or Procfile process (no ``+`` there): ``gpu0_2``."""
        return self.name.replace("+", "_")

    @property
    def cuda_visible_devices(self) -> str:
        """``CUDA_VISIBLE_DEVICES`` of the group's engine on the host (``0,1``)."""
        return ",".join(map(str, self.gpus))

    def describe(self) -> str:
        """``GPU 3`` or ``GPUs 0,1`` for log lines."""
        return f"GPU {self.first}" if self.size == 1 else f"GPUs {self.cuda_visible_devices}"


def is_gpu_queue(name: str) -> bool:
    """Whether ``name`` claims to name GPUs (starts with ``gpu`` and is not the shared queue)."""
    return name.startswith("gpu") and name != SHARED_QUEUE


def parse_group(text: str) -> GpuGroup:
    """The group a queue name or ``FLEET_GPU`` value names (``gpu`` prefix optional); raises
    GroupError for anything else, whitespace included."""
    body = text.removeprefix("gpu")
    gpus: list[int] | None = None
    if m := _SINGLE.fullmatch(body):
        gpus = [int(m.group(1))]
    elif (m := _RANGE.fullmatch(body)) and int(m.group(1)) < int(m.group(2)):
        gpus = list(range(int(m.group(1)), int(m.group(2)) + 1))
    elif _LIST.fullmatch(body):
        gpus = [int(p) for p in body.split("+")]
        if len(set(gpus)) != len(gpus):
            gpus = None
    if gpus is None:
        raise GroupError(f"queue {text!r} names no GPU: use {SPELLINGS}")
    return GpuGroup(tuple(sorted(gpus)))


def group_from_queues(queues: Iterable[str], override: str | None) -> tuple[GpuGroup, str]:
    """(group, its queue) from the worker's ``-Q`` queues and ``FLEET_GPU``.

    Exactly one queue may name GPUs; ``FLEET_GPU`` alone (queues ``gpu`` only) gives the
    group's canonical queue. Raises GroupError with one line in every other case.
    """
    named = [q for q in queues if is_gpu_queue(q)]
    groups = [(parse_group(q), q) for q in named]
    wanted = parse_group(override.strip()) if override is not None and override.strip() else None
    if len(groups) > 1:
        raise GroupError(f"queues {', '.join(named)}: a worker consumes exactly one GPU queue "
                         f"({SPELLINGS}); start one worker per GPU group")
    if not groups:
        if wanted is None:
            raise GroupError(f"queues {', '.join(queues) or '(none)'} name no GPU: consume one "
                             f"GPU queue (celery -A workers worker -Q gpu0) or set FLEET_GPU")
        return wanted, wanted.name
    group, queue = groups[0]
    if wanted is not None and wanted != group:
        raise GroupError(f"queue {queue} names {group.describe()} but FLEET_GPU={override} "
                         f"names {wanted.describe()}: drop one of them")
    return group, queue


def check_cuda_device(cuda_device: str | None, group: GpuGroup, queue: str) -> None:
    """``FLEET_CUDA_DEVICE`` (a container's own numbering) must name as many devices as the
    group has GPUs; raises GroupError otherwise."""
    if cuda_device is None or not cuda_device.strip():
        return
    devices = [d for d in cuda_device.split(",") if d.strip()]
    if len(devices) != group.size:
        raise GroupError(f"queue {queue} is {group.size} GPU(s) but FLEET_CUDA_DEVICE="
                         f"{cuda_device} names {len(devices)} device(s)")


def check_present(group: GpuGroup, queue: str, count: int, source: str,
                  indices: Sequence[int] | None = None) -> None:
    """GroupError naming the queue and the GPUs it names that this node does not have:
    ``count`` GPUs, numbered 0..count-1 (``source``: NVML, or FLEET_SIM_GPUS for the
    simulator). ``indices``: the group's GPUs as the node numbers them (a container's own
    devices, FLEET_CUDA_DEVICE), default the group's own."""
    seen = list(indices) if indices is not None else list(group.gpus)
    absent = [g for g, i in zip(group.gpus, seen, strict=True) if not 0 <= i < count]
    if absent:
        have = f"GPUs 0-{count - 1}" if count > 1 else "GPU 0" if count else "no GPU"
        names = ", ".join(map(str, absent))
        raise GroupError(f"queue {queue} names GPU {names}, but this node has {have} "
                         f"({source}): consume the queue of a GPU it has")


def node_host(node: str) -> str:
    """The host part of a Celery node name (``gpu0@box`` -> ``box``)."""
    return node.rpartition("@")[2] or node


def claim_ttl_s(heartbeat_interval_s: float) -> float:
    """How long a claim lives without renewal."""
    return max(CLAIM_MIN_TTL_S, 3 * heartbeat_interval_s)


def claim(r: redis.Redis, node: str, group: GpuGroup, queue: str, ttl_s: float) -> None:
    """Own every GPU of ``group`` as ``node`` (or renew the claims); raises GroupError naming
    the queue, the GPU and its owner when another live worker of this host holds one."""
    host = node_host(node)
    taken = scripts.claim_gpus(r, host, group.gpus, node, int(ttl_s * 1000))
    if taken:
        index, owner = int(taken[0]), taken[1]
        owner = owner.decode() if isinstance(owner, bytes) else str(owner)
        raise GroupError(f"queue {queue}: GPU {group.gpus[index - 1]} is owned by {owner}, a "
                         f"live worker of {host}; stop it or pick other GPUs")


def release(r: redis.Redis, node: str, group: GpuGroup) -> None:
    """Drop ``node``'s claims on ``group`` (a warm shutdown)."""
    scripts.release_gpus(r, node_host(node), group.gpus, node)
