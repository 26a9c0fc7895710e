"""Splitting a held batch at the job's end: its unsent rows move to an idle GPU as a *part*.

When the queue is empty, a GPU has room, and a batch another GPU holds still has rows it has
not sent, the idle GPU would wait for the job's end. Instead its worker asks for those rows
(a request key, :func:`request_rows`) and the batch's owner answers at its next look
(:data:`GRANT`, fenced by the owner's ownership token): rows it has not sent become a part,
claimed by the asker under a key of the part's own, renewed like a batch claim
(workers/delivery/ownership.py). The part's rows are recorded into the batch's progress hash by
the same script the owner uses (``jobstate.RECORD_ROWS``), fenced by the part's key instead of
the batch's, so a part whose claim lapsed (its worker killed, or frozen past its lease) records
nothing more.

The owner, once it has sent the rest, waits while a part is live and then sends whatever is
still missing: nothing, or the rows of a part that lapsed. Its result is written from the
progress hash as before, so the parts are merged by construction and every row is recorded
once (``HSETNX``). The owner dying mid-split changes nothing for the part: the batch's message
is redelivered (acks late) and its next owner waits for the live parts the same way.

Keys (under the job's): ``split:B`` the request (one at a time per batch), ``part:B:P`` the
part's claim (its asker's token), ``partrows:B:P`` its unit keys, ``parts:B`` the part ids.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import orjson
import redis
import redis.asyncio as aioredis

from workers.delivery import jobstate
from workers.delivery.gpu_share import STALE_S, Claim, decode_all

PART_MARK = "+"  # in a part's GPU-share tag ("job/batch+part"): a part is not split again
REQUEST_TTL_MS = 5000  # an unanswered request (its owner gone) clears itself
PARTS_TTL_S = 7 * 24 * 3600  # leftover part lists of a job never finished

# KEYS: owner, request, part, part rows, parts, the job's hash; ARGV: owner token, the request
# as read, part claim TTL (ms), part id, parts TTL (s), unit keys...
# -1: the caller does not own the batch; 0: the request changed or is gone; 1: granted (the
# job's ``jobstate.SPLIT_FIELDS`` count it).
GRANT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return 0 end
local req = cjson.decode(ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('SET', KEYS[3], req['token'], 'PX', ARGV[3])
for i = 6, #ARGV do redis.call('SADD', KEYS[4], ARGV[i]) end
redis.call('SADD', KEYS[5], ARGV[4])
redis.call('EXPIRE', KEYS[4], ARGV[5])
redis.call('EXPIRE', KEYS[5], ARGV[5])
redis.call('HINCRBY', KEYS[6], 'parts_granted', 1)
redis.call('HINCRBY', KEYS[6], 'rows_split', #ARGV - 5)
return 1
"""

# KEYS: request; ARGV: the request as read. Deletes it only if it is still that one.
DROP_REQUEST = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def request_key(job: str, batch: int) -> str:
    """The batch's open split request."""
    return f"{jobstate.Keys(job).job}:split:{batch}"


def part_key(job: str, batch: int, part: str) -> str:
    """A part's claim: its asker's token while the part is live."""
    return f"{jobstate.Keys(job).job}:part:{batch}:{part}"


def part_rows_key(job: str, batch: int, part: str) -> str:
    """The unit keys a part holds."""
    return f"{jobstate.Keys(job).job}:partrows:{batch}:{part}"


def parts_key(job: str, batch: int) -> str:
    """The ids of the batch's parts."""
    return f"{jobstate.Keys(job).job}:parts:{batch}"


@dataclass(frozen=True)
class Part:
    """The rows of another GPU's batch granted to this run."""

    id: str
    rows: frozenset[str]  # unit keys


@dataclass(frozen=True)
class Request:
    """An idle worker's ask for a batch's unsent rows."""

    part: str
    token: str
    raw: str  # as stored: the grant compares it whole

    @classmethod
    def new(cls, token: str) -> Request:
        """A request under a fresh part id, for the asker's ownership ``token``."""
        part = secrets.token_hex(6)
        return cls(part, token, orjson.dumps({"part": part, "token": token}).decode())

    @classmethod
    def decode(cls, raw: bytes) -> Request | None:
        """None for a value this code did not write."""
        try:
            d = orjson.loads(raw)
            return cls(str(d["part"]), str(d["token"]), raw.decode())
        except (orjson.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            return None


def rows_to_move(unsent: int, in_flight: int) -> int:
    """How many unsent rows the owner gives: as many as leave both GPUs about the same work
    (its in-flight requests stay its own), at most all it has not sent."""
    return min(unsent, math.ceil((unsent + in_flight) / 2))


@dataclass(frozen=True)
class Candidate:
    """A batch another GPU holds, with rows it has not sent."""

    job: str
    batch: int
    node: str
    unsent: int


def split_tag(tag: str) -> tuple[str, int] | None:
    """(job, batch) of a GPU-share tag ``job/batch``; None for a part's tag or another one."""
    if PART_MARK in tag:
        return None
    job, _, batch = tag.rpartition("/")
    return (job, int(batch)) if job and batch.isdigit() else None


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


# --- the asker -------------------------------------------------------------------------------
async def request_rows(r: aioredis.Redis, job: str, batch: int, token: str) -> Request | None:
    """Open a split request on the batch; None when another asker's is open."""
    req = Request.new(token)
    ok = await r.set(request_key(job, batch), req.raw, nx=True, px=REQUEST_TTL_MS)
    return req if ok else None


async def await_grant(r: aioredis.Redis, job: str, batch: int, req: Request,
                      timeout_s: float) -> frozenset[str]:
    """The unit keys granted to ``req`` (empty when refused or unanswered within
    ``timeout_s``; an unanswered request is withdrawn)."""
    deadline = time.monotonic() + timeout_s
    pkey = part_key(job, batch, req.part)
    while True:
        claim, open_req = await r.mget(pkey, request_key(job, batch))
        if claim == req.token.encode():
            return frozenset(k.decode() for k in
                             await r.smembers(part_rows_key(job, batch, req.part)))
        if open_req != req.raw.encode() or time.monotonic() > deadline:
            await r.eval(DROP_REQUEST, 1, request_key(job, batch), req.raw)
            # A grant between the last read and the withdrawal still counts.
            if await r.get(pkey) == req.token.encode():
                continue
            return frozenset()
        await asyncio.sleep(0.05)


# --- the owner ----------------------------------------------------------------------------------
async def open_request(r: aioredis.Redis, job: str, batch: int) -> Request | None:
    """The batch's open split request, if any."""
    raw = await r.get(request_key(job, batch))
    return Request.decode(raw) if raw else None


async def grant(r: aioredis.Redis, job: str, batch: int, owner_token: str, req: Request,
                unit_keys: list[str], ttl_s: float) -> int:
    """Give ``unit_keys`` to the asker of ``req`` (see :data:`GRANT` for the answer)."""
    k = jobstate.Keys(job)
    return int(await r.eval(
        GRANT, 6, k.owner(batch), request_key(job, batch), part_key(job, batch, req.part),
        part_rows_key(job, batch, req.part), parts_key(job, batch), k.job,
        owner_token, req.raw, int(ttl_s * 1000), req.part, PARTS_TTL_S, *unit_keys))


async def refuse(r: aioredis.Redis, job: str, batch: int, req: Request) -> None:
    """Drop ``req`` (nothing worth moving): its asker stops waiting at once."""
    await r.eval(DROP_REQUEST, 1, request_key(job, batch), req.raw)


async def live_part_rows(r: aioredis.Redis, job: str, batch: int) -> frozenset[str]:
    """Unit keys held by the batch's live parts (their claims not lapsed nor released)."""
    parts = [p.decode() for p in await r.smembers(parts_key(job, batch))]
    if not parts:
        return frozenset()
    live = await r.mget([part_key(job, batch, p) for p in parts])
    held: set[str] = set()
    for part, claim in zip(parts, live, strict=True):
        if claim is not None:
            held |= {k.decode() for k in await r.smembers(part_rows_key(job, batch, part))}
    return frozenset(held)


async def drop_parts(r: aioredis.Redis, job: str, batch: int) -> None:
    """Forget the batch's parts once its result is written (each has ended by then)."""
    parts = [p.decode() for p in await r.smembers(parts_key(job, batch))]
    keys = [parts_key(job, batch)]
    for p in parts:
        keys += [part_key(job, batch, p), part_rows_key(job, batch, p)]
    await r.delete(*keys)


def node_claims(r: redis.Redis, nodes: Iterable[str]) -> dict[str, list[Claim]]:
    """Every node's GPU-share claims (their in-flight hashes), in one round trip."""
    nodes = list(nodes)
    with r.pipeline(transaction=False) as pipe:
        for node in nodes:
            pipe.hgetall(jobstate.in_flight_key(node))
        raws = pipe.execute()
    return {node: decode_all(raw) for node, raw in zip(nodes, raws, strict=True)}
