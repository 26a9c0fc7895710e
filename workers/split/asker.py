"""The idle GPU's side of a split: which batch to ask, the ask, and the wait for the grant.

At the job's end a worker with room (it holds nothing, or its batches have nothing left to
send and leave the GPU's in-flight budget room: the hold would take another batch), empty
queues and a healthy engine sends itself a take task for another GPU's batch with the most
unsent rows (:class:`SplitAsker`). The take task asks the batch's owner for them
(:func:`ask`) and generates those granted as a part.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from workers.delivery.gpu_share import STALE_S, Claim, decode_all
from workers.delivery.ownership import Ownership, make_token
from workers.node import context
from workers.node.heartbeat import read_heartbeats
from workers.node.queues import TAKE_TASK
from workers.redisdb import scripts
from workers.redisdb.keys import JobKeys, NodeKeys
from workers.split.protocol import REQUEST_TTL_MS, Part, Request, split_tag

log = logging.getLogger(__name__)

ASK_EVERY_S = 0.5
ASK_COOLDOWN_S = 3.0  # the take task sent is reserved (held) well within it
# How long an idle worker waits for a batch's owner to answer its request (the owner looks
# every half second).
GRANT_WAIT_S = 3.0


@dataclass(frozen=True)
class Candidate:
    """A batch another GPU holds, with rows it has not sent."""

    job: str
    batch: int
    node: str
    unsent: int


def choose(claims_by_node: Mapping[str, Iterable[Claim]], me: str, min_rows: int,
           now: float) -> Candidate | None:
    """The live batch of another node with the most unsent rows, if it has ``min_rows``.
    A batch isolating crash suspects is left alone (it needs its engine to itself)."""
    best: Candidate | None = None
    for node, claims in claims_by_node.items():
        if node == me:
            continue
        for c in claims:
            named = split_tag(c.tag)
            if (named is None or c.exclusive or now - c.at > STALE_S
                    or c.unsent < max(min_rows, 1)):
                continue
            if best is None or c.unsent > best.unsent:
                best = Candidate(named[0], named[1], node, c.unsent)
    return best


def node_claims(r: redis.Redis, nodes: Iterable[str]) -> dict[str, list[Claim]]:
    """Every node's GPU-share claims (their in-flight hashes), in one round trip."""
    nodes = list(nodes)
    with r.pipeline(transaction=False) as pipe:
        for node in nodes:
            pipe.hgetall(NodeKeys(node).in_flight)
        raws = pipe.execute()
    return {node: decode_all(raw) for node, raw in zip(nodes, raws, strict=True)}


class SplitAsker:
    """The elastic hold's look for another GPU's unsent rows (see the module docstring): a
    GPU running its own batch's last rows fills its free slots with another GPU's unsent ones
    instead of waiting to run dry."""

    def __init__(self, app: Any, client: redis.Redis, queues: list[str], min_rows: int) -> None:
        self.app, self.redis, self.queues, self.min_rows = app, client, queues, min_rows
        self._next = 0.0

    def __call__(self) -> None:
        """One look (at most every ASK_EVERY_S; after an ask, not before ASK_COOLDOWN_S)."""
        now = time.monotonic()
        if now < self._next or self.min_rows <= 0:
            return
        self._next = now + ASK_EVERY_S
        me = context.identity()
        with self.redis.pipeline(transaction=False) as pipe:
            for q in self.queues:
                pipe.llen(q)
            if any(pipe.execute()):
                return
        beats = {b["node"]: b for b in read_heartbeats(self.redis)}
        if beats.get(me.node, {}).get("engine_state") != "healthy":
            return
        found = choose(node_claims(self.redis, beats), me.node, self.min_rows, time.time())
        if found is None:
            return
        self.app.send_task(TAKE_TASK, args=(found.job, found.batch), queue=me.gpu_queue)
        self._next = now + ASK_COOLDOWN_S
        log.info("asking %s for the %d unsent rows of batch %s/%d", found.node, found.unsent,
                 found.job, found.batch)


async def request_rows(r: aioredis.Redis, job: str, batch: int, token: str) -> Request | None:
    """Open a split request on the batch; None when another asker's is open."""
    req = Request.new(token)
    ok = await r.set(JobKeys(job).split_request(batch), req.raw, nx=True, px=REQUEST_TTL_MS)
    return req if ok else None


async def await_grant(r: aioredis.Redis, job: str, batch: int, req: Request,
                      timeout_s: float) -> frozenset[str]:
    """The unit keys granted to ``req`` (empty when refused or unanswered within
    ``timeout_s``; an unanswered request is withdrawn)."""
    deadline = time.monotonic() + timeout_s
    k = JobKeys(job)
    pkey = k.part(batch, req.part)
    while True:
        claim, open_req = await r.mget(pkey, k.split_request(batch))
        if claim == req.token.encode():
            return frozenset(x.decode() for x in await r.smembers(k.part_rows(batch, req.part)))
        if open_req != req.raw.encode() or time.monotonic() > deadline:
            await scripts.release_if_owner(r, k.split_request(batch), req.raw)
            # A grant between the last read and the withdrawal still counts.
            if await r.get(pkey) == req.token.encode():
                continue
            return frozenset()
        await asyncio.sleep(0.05)


async def ask(r: aioredis.Redis, job: str, batch: int, node: str, ttl_s: float
              ) -> tuple[Part, Ownership] | str:
    """Ask the owner of ``batch`` for its unsent rows: the part granted and this run's claim
    on it (not yet kept), or why there is none."""
    token = make_token(node)
    asked_at = time.monotonic()
    req = await request_rows(r, job, batch, token)
    if req is None:
        return "another GPU asks for its rows"
    rows = await await_grant(r, job, batch, req, GRANT_WAIT_S)
    if not rows:
        return "its owner kept its rows"
    claim = Ownership.of_part(r, job, batch, node, ttl_s, JobKeys(job).part(batch, req.part),
                              token, asked_at)
    return Part(req.part, rows), claim
