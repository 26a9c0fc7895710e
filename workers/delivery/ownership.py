"""Who may write a batch: one fencing token per delivery, held in Redis with an expiry.

Delivery is at least once: a lease that lapses (a frozen VM), a duplicate message (a
reconcile racing a delivery) or a pause/resume can start a second run of a batch while the
first still lives. Each run draws a token and claims the batch's owner key with it; the
key expires unless its owner renews it. Progress writes (``scripts.record_rows``) and the
finish step (``scripts.finish_batch``) are refused to any other token, and the owner checks
its claim right before it writes the result object, so a run that lost the batch stops within
one renewal period and never overwrites the new owner's work.

The token reads ``node|worker pid|pool pid|random``: the worker's main process renews the
broker lease of the deliveries its own pool owns (workers/delivery/lease.py), and a run that
finds the batch held by a pool process of its own worker that is gone takes it over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import redis
import redis.asyncio as aioredis

from workers.aio import cancel_and_wait
from workers.errors import FleetError
from workers.redisdb import scripts
from workers.redisdb.keys import JobKeys


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
        self.redis, self.job, self.batch, self.node = r, job, batch, node
        self.keys = JobKeys(job)
        self.key = self.keys.owner(batch)
        self.token = make_token(node)
        self.ttl_ms = int(ttl_s * 1000)
        self._keeper: asyncio.Task[None] | None = None
        self._renewed_at = time.monotonic()  # the claim is known to hold until ttl after this
        self._confirming: asyncio.Lock | None = None
        self._extend_only = False

    def __repr__(self) -> str:
        return f"<Ownership {self.key} {self.token}>"

    @classmethod
    def of_part(cls, r: aioredis.Redis, job: str, batch: int, node: str, ttl_s: float,
                key: str, token: str, asked_at: float) -> Ownership:
        """The claim on a part of a batch (workers/split/), granted under ``key``
        for ``token`` after ``asked_at`` (monotonic): renewed, confirmed and released like a
        batch claim, and it lapses with the batch's done mark as well."""
        part = cls(r, job, batch, node, ttl_s)
        part.key, part.token, part._renewed_at = key, token, asked_at
        # Extended only, never taken again once lapsed: the batch's owner reads a lapsed part
        # as its rows given back, and may be sending them itself already.
        part._extend_only = True
        return part

    async def _claim(self, reopen: bool, steal_from: str) -> tuple[str, str]:
        status, cur = await scripts.claim_batch(self.redis, self.job, self.batch, self.token,
                                                 self.ttl_ms, reopen, steal_from)
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
        if self._extend_only:
            ok = bool(await scripts.extend_if_owner(self.redis, self.key, self.token,
                                                    self.ttl_ms))
        else:
            ok = bool(await scripts.take_or_keep(self.redis, self.key, self.token, self.ttl_ms,
                                                 unless_in=(self.keys.done, self.batch)))
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
            await self._renew_or_raise(lapsed_after_s=-1.0)  # a failure now is a lapse

    def start_keeping(self, renew_s: float) -> None:
        """Renew the claim every ``renew_s`` in the background until :meth:`stop_keeping`."""
        self._keeper = asyncio.ensure_future(self._keep(renew_s))

    @contextlib.asynccontextmanager
    async def kept(self, renew_s: float) -> AsyncIterator[None]:
        """Renew the claim while the body runs, then release it (a no-op once finished or
        taken over; a release that fails lets the claim lapse by itself)."""
        self.start_keeping(renew_s)
        try:
            yield
        finally:
            await self.stop_keeping()
            try:
                await self.release()
            except (redis.RedisError, OSError):
                pass

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
        while True:
            await asyncio.sleep(renew_s)
            await self._renew_or_raise(lapsed_after_s=self.ttl_ms / 1000 - renew_s)

    async def _renew_or_raise(self, lapsed_after_s: float) -> None:
        """Renew the claim: LostOwnership when another run owns the batch; ClaimLapsed when
        Redis fails and the last renewal is more than ``lapsed_after_s`` old (a failure before
        that is left to the next try)."""
        try:
            ok = await self.renew()
        except (redis.RedisError, OSError) as exc:
            silent = time.monotonic() - self._renewed_at
            if silent > lapsed_after_s:
                raise ClaimLapsed(f"claim on {self.key} not renewed for {silent:.0f} s: {exc}"
                                  ) from exc
            return
        if not ok:
            raise LostOwnership(f"{self.key} is owned by another run now")

    async def still_owned(self) -> bool:
        """Whether this run still owns the batch (checked right before the result is written)."""
        return await self.redis.get(self.key) == self.token.encode()

    async def release(self) -> None:
        """Give the batch up (handed back, stopped, failed) so the next run need not wait."""
        await scripts.release_if_owner(self.redis, self.key, self.token)


def reopen(r: redis.Redis, job: str, batch: int) -> bool:
    """Forget ``batch``'s done mark and counts (its result is not in the store) unless a run
    owns it; True when nothing owns it."""
    return bool(scripts.reopen_batch(r, job, batch))


def live_holders(r: redis.Redis, job: str) -> dict[int, str]:
    """Batches of ``job`` that a run owns now, with its token (derived from the owner keys,
    which expire with their run)."""
    prefix = JobKeys(job).owner_prefix()
    keys = sorted(r.scan_iter(match=f"{prefix}*", count=1000))
    if not keys:
        return {}
    tokens = r.mget(keys)
    return {int(k[len(prefix):]): t.decode() for k, t in zip(keys, tokens, strict=True)
            if t is not None}
