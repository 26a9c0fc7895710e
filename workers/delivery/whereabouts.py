"""Where each batch of a job is, derived when it matters, and the reconcile that resends the rest.

Nothing remembered beside the broker is trusted to say that a message exists: a failover that
keeps one write and loses the next, a pause that pulls queued messages, a killed worker or a
revoked task would make such a mark lie. A batch is

- *stored* when its result object is in the store (the only proof of done),
- *queued* when a message for it sits in one of the queue lists (shared, pinned, priorities),
- *unacked* when kombu's Redis transport holds its delivered message (the ``unacked`` hash:
  ``kombu.transport.redis.QoS.append`` writes ``[payload, exchange, routing_key]`` per tag),
- *held* when a run owns it (its owner key lives, workers/delivery/ownership.py).

``reconcile`` (``enqueue`` and ``resume``) sends every batch that is none of these.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import orjson
import redis
from celery import Celery

from workers.dataset.jobs import JobSpec, decode_rows, result_key
from workers.dataset.store import Store
from workers.dataset.verify import stored_batches
from workers.delivery import jobstate, ownership
from workers.node.queues import BATCH_TASK, SHARED_QUEUE
from workers.redisdb.keys import JobKeys


def message_batch(payload: bytes | dict) -> tuple[str, int] | None:
    """(job, batch) of a kombu message carrying fleet.run_batch, else None."""
    try:
        msg = orjson.loads(payload) if isinstance(payload, bytes | str) else payload
        if msg.get("headers", {}).get("task") != BATCH_TASK:
            return None
        args = orjson.loads(base64.b64decode(msg["body"]))[0]
        return str(args[0]), int(args[1])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError,
            AttributeError):
        return None


def queue_lists(r: redis.Redis) -> list[bytes]:
    """The Redis lists that hold batch messages (shared and pinned queues, all priorities)."""
    names: set[bytes] = set()
    for pattern in (SHARED_QUEUE, f"{SHARED_QUEUE}[0-9]*"):
        names.update(r.scan_iter(match=f"{pattern}*", _type="LIST"))
    return sorted(names)


def _queued(r: redis.Redis, job: str) -> Iterator[tuple[bytes, bytes, int]]:
    """(queue list, message, batch) of each message of ``job`` waiting in a queue list."""
    for name in queue_lists(r):
        for raw in r.lrange(name, 0, -1):
            found = message_batch(raw)
            if found and found[0] == job:
                yield name, raw, found[1]


def queued_batches(r: redis.Redis, job: str) -> set[int]:
    """Batches of ``job`` with a message waiting in a queue list."""
    return {batch for _, _, batch in _queued(r, job)}


def unacked_batches(r: redis.Redis, job: str, unacked_key: str = "unacked") -> set[int]:
    """Batches of ``job`` whose message a worker has taken and not yet acknowledged."""
    out: set[int] = set()
    for raw in r.hvals(unacked_key):
        try:
            payload = orjson.loads(raw)[0]
        except (orjson.JSONDecodeError, IndexError, TypeError):
            continue
        found = message_batch(payload)
        if found and found[0] == job:
            out.add(found[1])
    return out


def remove_queued(r: redis.Redis, job: str) -> int:
    """Remove every queued (not yet delivered) batch message of ``job``; return how many."""
    return sum(int(r.lrem(name, 1, raw)) for name, raw, _ in _queued(r, job))


@dataclass
class Whereabouts:
    """Where the batches of one job are (see the module docstring)."""

    stored: set[int] = field(default_factory=set)
    queued: set[int] = field(default_factory=set)
    unacked: set[int] = field(default_factory=set)
    held: set[int] = field(default_factory=set)

    def has_message_or_holder(self, batch: int) -> bool:
        """Whether something will run ``batch`` without a resend."""
        return batch in self.queued or batch in self.unacked or batch in self.held

    def lost(self, batches: Iterable[int]) -> list[int]:
        """Batches neither stored nor queued, unacked or held: only a resend will run them."""
        return [b for b in batches if b not in self.stored and not self.has_message_or_holder(b)]


def locate(store: Store, r: redis.Redis, job: str, unacked_key: str = "unacked") -> Whereabouts:
    """Where every batch of ``job`` is now. The broker is read before the holders so that a
    message taken in between still shows as held (a run claims before it acks)."""
    queued = queued_batches(r, job)
    unacked = unacked_batches(r, job, unacked_key)
    held = set(ownership.live_holders(r, job))
    return Whereabouts(stored=set(stored_batches(store, job)), queued=queued, unacked=unacked,
                       held=held)


def count_stored(store: Store, r: redis.Redis, job: str, batch: int) -> None:
    """Make Redis agree with a stored batch: done, and counted exactly as its rows say (also
    when the rows were counted live and the finish step has not run yet)."""
    rows = decode_rows(store.get(result_key(job, batch)))
    jobstate.set_batch_counts(r, job, batch, jobstate.batch_counts(rows))
    r.sadd(JobKeys(job).done, batch)


@dataclass
class ReconcileReport:
    """What one reconcile found and did."""

    already_done: int = 0
    already_pending: int = 0
    enqueued: int = 0


def resend(r: redis.Redis, app: Celery, spec: JobSpec, batches: list[int]) -> int:
    """Send ``batches`` (found lost: not stored, no message, no live owner), dropping a done
    mark the store contradicts first; return how many were sent."""
    done = {int(b) for b in r.smembers(JobKeys(spec.name).done)}
    with app.producer_or_acquire() as producer:
        for b in batches:
            if b in done:  # the store lost the result: the done mark lies
                ownership.reopen(r, spec.name, b)
            app.send_task(BATCH_TASK, args=[spec.name, b], queue=SHARED_QUEUE,
                          producer=producer)
    return len(batches)


def reconcile(store: Store, r: redis.Redis, app: Celery, spec: JobSpec,
              unacked_key: str = "unacked") -> ReconcileReport:
    """Send every batch that is not stored and has no message and no live holder."""
    where = locate(store, r, spec.name, unacked_key)
    done = {int(b) for b in r.smembers(JobKeys(spec.name).done)}
    report = ReconcileReport()
    for b in sorted(where.stored):
        if b < spec.n_batches and b not in done:
            count_stored(store, r, spec.name, b)
    report.already_done = sum(b in where.stored for b in range(spec.n_batches))
    report.already_pending = sum(b not in where.stored and where.has_message_or_holder(b)
                                 for b in range(spec.n_batches))
    report.enqueued = resend(r, app, spec, where.lost(range(spec.n_batches)))
    return report
