"""Who may write a batch: one fencing token per delivery, held in Redis with an expiry.

Delivery is at least once: a lease that lapses (a frozen VM), a duplicate message (a
reconcile racing a delivery) or a pause/resume can start a second run of a batch while the
first still lives. Each run draws a token and claims ``fleet:job:{j}:owner:{b}`` with it; the
key expires unless its owner renews it. Progress writes (``jobstate.RECORD_ROWS``) and the
finish step (``jobstate.FINISH_BATCH``) are refused to any other token, and the owner checks
its claim right before it writes the result object, so a run that lost the batch stops within
one renewal period and never overwrites the new owner's work.

The token reads ``node|worker pid|pool pid|random``: the worker's main process renews the
broker lease of the deliveries its own pool owns (workers/delivery/lease.py), and a run that
finds the batch held by a pool process of its own worker that is gone takes it over at once.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import redis
import redis.asyncio as aioredis

from workers.aio import cancel_and_wait
from workers.dataset.sink_lock import EXTEND, TAKE_OR_KEEP
from workers.dataset.sink_lock import RELEASE as LOCK_RELEASE
from workers.delivery import jobstate
from workers.errors import FleetError

_ZERO_COUNTS = """
local function zero_counts(stats, bstats, batch)
  for _, f in ipairs({'completed', 'failed', 'quarantined', 'truncated', 'output_tokens'}) do
    local k = batch .. '|' .. f
    local old = tonumber(redis.call('HGET', bstats, k) or '0')
    if old ~= 0 then redis.call('HINCRBY', stats, f, -old) end
    redis.call('HDEL', bstats, k)
  end
end
"""

# KEYS: owner, done, stats, bstats, progress
# ARGV: batch, token, ttl ms, reopen ('1': the store lacks the result, drop a stale done mark),
#       the token of a holder known to be dead ('' if none)
CLAIM = _ZERO_COUNTS + """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[2] and cur ~= ARGV[5] then return {'held', cur} end
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  if ARGV[4] ~= '1' then return {'done', ''} end
  redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('DEL', KEYS[5])
  zero_counts(KEYS[3], KEYS[4], ARGV[1])
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {'ok', cur or ''}
"""

# KEYS: owner, done, stats, bstats, progress; ARGV: batch. A done mark whose result object is
# gone (deleted by hand, another store): forget it and the batch's counts, unless a run owns it.
REOPEN = _ZERO_COUNTS + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('SREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('DEL', KEYS[5])
  zero_counts(KEYS[3], KEYS[4], ARGV[1])
end
return 1
"""

# KEYS: owner, done; ARGV: token, ttl ms, batch. A claim that lapsed while nobody else took
# the batch (a frozen process, a slow Redis) is taken again: the message is still this run's.
# The data-set lock's scripts (workers/dataset/sink_lock.py) are the one implementation.
RENEW = TAKE_OR_KEEP
RELEASE = LOCK_RELEASE


class LostOwnership(FleetError):
    """Another run owns the batch now: stop sending and write nothing more."""


class ClaimLapsed(LostOwnership):
    """The claim could not be renewed for about a lease (Redis unreachable): stop sending and
    hand the batch back, since nobody may know that this run still holds it."""


def make_token(node: str) -> str:
    """A new token for a run in this pool process (see the module docstring)."""
    return f"{node}|{os.getppid()}|{os.getpid()}|{uuid.uuid4().hex[:12]}"


def worker_prefix(node: str, main_pid: int) -> str:
    """The start of every token drawn by the pool of the worker ``node`` whose pid is given."""
    return f"{node}|{main_pid}|"


def _pid_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie not yet reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def dead_sibling(token: str, node: str) -> bool:
    """Whether ``token`` was drawn by another pool process of this worker that is gone."""
    parts = token.split("|")
    if len(parts) != 4 or parts[0] != node or parts[1] != str(os.getppid()):
        return False
    try:
        pid = int(parts[2])
    except ValueError:
        return False
    return pid != os.getpid() and _pid_gone(pid)


@dataclass(frozen=True)
class Claimed:
    """The outcome of :meth:`Ownership.acquire`: ``ok``, ``done`` or ``held``."""

    status: str
    holder: str = ""


class Ownership:
    """This run's claim on one batch."""

    def __init__(self, r: aioredis.Redis, job: str, batch: int, node: str, ttl_s: float) -> None:
        self.redis, self.batch, self.node = r, batch, node
        self.keys = jobstate.Keys(job)
        self.key = self.keys.owner(batch)
        self.token = make_token(node)
        self.ttl_ms = int(ttl_s * 1000)
        self._keeper: asyncio.Task[None] | None = None
        self._renewed_at = time.monotonic()  # the claim is known to hold until ttl after this
        self._confirming: asyncio.Lock | None = None
        self._renew_script = RENEW

    def __repr__(self) -> str:
        return f"<Ownership {self.key} {self.token}>"

    @classmethod
    def of_part(cls, r: aioredis.Redis, job: str, batch: int, node: str, ttl_s: float,
                key: str, token: str, asked_at: float) -> Ownership:
        """The claim on a part of a batch (workers/delivery/split.py), granted under ``key``
        for ``token`` after ``asked_at`` (monotonic): renewed, confirmed and released like a
        batch claim, and it lapses with the batch's done mark as well."""
        part = cls(r, job, batch, node, ttl_s)
        part.key, part.token, part._renewed_at = key, token, asked_at
        # Extended only, never taken again once lapsed: the batch's owner reads a lapsed part
        # as its rows given back, and may be sending them itself already.
        part._renew_script = EXTEND
        return part

    async def _claim(self, reopen: bool, steal_from: str) -> tuple[str, str]:
        k = self.keys
        status, cur = await self.redis.eval(
            CLAIM, 5, self.key, k.done, k.stats, k.bstats, k.progress(self.batch),
            self.batch, self.token, self.ttl_ms, "1" if reopen else "0", steal_from)
        return status.decode(), cur.decode()

    async def acquire(self, result_stored: Callable[[], Awaitable[bool]],
                      wait_s: float) -> Claimed:
        """Claim the batch. A done mark is trusted only if ``result_stored()`` agrees; a live
        holder is waited for up to ``wait_s`` (it may be a run that just died and whose claim
        has not expired yet), a pool process of this worker that is gone is replaced at once."""
        deadline = time.monotonic() + wait_s
        reopen, steal = False, ""
        while True:
            status, cur = await self._claim(reopen, steal)
            if status == "ok":
                self._renewed_at = time.monotonic()
                return Claimed("ok", cur)
            if status == "done":
                if await result_stored():
                    return Claimed("done")
                reopen = True
            elif dead_sibling(cur, self.node):
                steal = cur
            elif time.monotonic() > deadline:
                return Claimed("held", cur)
            else:
                await asyncio.sleep(1.0)

    async def renew(self) -> bool:
        """Extend the claim; False once another run owns the batch (or nobody does)."""
        asked_at = time.monotonic()
        ok = bool(await self.redis.eval(self._renew_script, 2, self.key, self.keys.done, self.token,
                                        self.ttl_ms, self.batch))
        if ok:
            self._renewed_at = max(self._renewed_at, asked_at)
        return ok

    async def confirm(self, margin_s: float) -> None:
        """Return only while the claim surely holds; raise LostOwnership otherwise.

        The claim holds for ttl after its last renewal. Past ``ttl - margin_s`` of that (a
        process frozen past its lease, a stalled loop) it may have lapsed and another run may
        own the batch, so it is renewed first: a woken run sends nothing more on a lost claim,
        not even in the second before its keeper finds out."""
        if (lost := self.lost()) is not None:
            raise lost
        if time.monotonic() - self._renewed_at < self.ttl_ms / 1000 - margin_s:
            return
        if self._confirming is None:
            self._confirming = asyncio.Lock()
        async with self._confirming:  # the many senders waiting share one renewal
            if time.monotonic() - self._renewed_at < self.ttl_ms / 1000 - margin_s:
                return
            try:
                ok = await self.renew()
            except (redis.RedisError, OSError) as exc:
                raise ClaimLapsed(f"claim on {self.key} not renewed for "
                                  f"{time.monotonic() - self._renewed_at:.0f} s: {exc}") from exc
            if not ok:
                raise LostOwnership(f"{self.key} is owned by another run now")

    def start_keeping(self, renew_s: float) -> None:
        """Renew the claim every ``renew_s`` in the background until :meth:`stop_keeping`."""
        self._keeper = asyncio.ensure_future(self._keep(renew_s))

    async def stop_keeping(self) -> None:
        """Stop renewing (the claim then lapses unless finished or released)."""
        if self._keeper is not None:
            await cancel_and_wait(self._keeper)

    def lost(self) -> LostOwnership | None:
        """Why the claim was lost, once the keeper has found out (None while it holds)."""
        k = self._keeper
        if k is None or not k.done() or k.cancelled():
            return None
        exc = k.exception()
        return exc if isinstance(exc, LostOwnership) else LostOwnership(str(exc))

    async def _keep(self, renew_s: float) -> None:
        """Raise LostOwnership when another run owns the batch, or when the claim could not be
        renewed for so long that it may have lapsed (Redis unreachable or a frozen process)."""
        ttl_s = self.ttl_ms / 1000
        while True:
            await asyncio.sleep(renew_s)
            try:
                ok = await self.renew()
            except (redis.RedisError, OSError) as exc:
                if time.monotonic() - self._renewed_at > ttl_s - renew_s:
                    raise ClaimLapsed(f"claim on {self.key} not renewed for "
                                        f"{time.monotonic() - self._renewed_at:.0f} s: {exc}"
                                        ) from exc
                continue
            if not ok:
                raise LostOwnership(f"{self.key} is owned by another run now")

    async def still_owned(self) -> bool:
        """Whether this run still owns the batch (checked right before the result is written)."""
        return await self.redis.get(self.key) == self.token.encode()

    async def release(self) -> None:
        """Give the batch up (handed back, stopped, failed) so the next run need not wait."""
        await self.redis.eval(RELEASE, 1, self.key, self.token)


def reopen(r: redis.Redis, job: str, batch: int) -> bool:
    """Forget ``batch``'s done mark and counts (its result is not in the store) unless a run
    owns it; True when nothing owns it."""
    k = jobstate.Keys(job)
    return bool(r.eval(REOPEN, 5, k.owner(batch), k.done, k.stats, k.bstats,
                       k.progress(batch), batch))


def live_holders(r: redis.Redis, job: str) -> dict[int, str]:
    """Batches of ``job`` that a run owns now, with its token (derived from the owner keys,
    which expire with their run)."""
    prefix = jobstate.Keys(job).owner(0)[:-1]
    keys = sorted(r.scan_iter(match=f"{prefix}*", count=1000))
    if not keys:
        return {}
    tokens = r.mget(keys)
    return {int(k[len(prefix):]): t.decode() for k, t in zip(keys, tokens, strict=True)
            if t is not None}
