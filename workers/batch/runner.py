"""Run one batch against the local engine: concurrent requests, durable progress, results.

Prompts already answered (the batch's progress hash in Redis) are not sent again, so a
redelivered batch or a restarted engine only costs the prompts that were in flight.

A prompt with N samples is N units of work, each sent as its own request (with its own seed,
workers/batch/prompt_sampling.py) and recorded once under its (index, sample) key. Before its
samples go, the prompt is prefilled once with a request that generates nothing, as SGLang's own
parallel sampling does (``TokenizerManager._handle_batch_request`` sends each prompt with
``max_new_tokens = 0`` to cache the common prefix, then the ``n`` copies): the samples then
find the prompt in the radix cache and cost one prefill between them.
Per-prompt errors become failed rows with a reason; an engine that stays down hands the batch
back to the queue.

The batches on one GPU share one in-flight budget, oldest batch first
(workers/delivery/gpu_share.py), so their tails overlap instead of coinciding.

Poison prompts: prompts in flight when the engine crashes are set aside as suspects and, once
the rest of the batch is done, re-sent in halving groups. Only a crash while a suspect runs
alone counts against it again; at ``poison_crashes`` crashes it is quarantined.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from redis.exceptions import RedisError

from workers.aio import cancel_and_wait
from workers.batch import results
from workers.batch.limiter import Limiter
from workers.batch.prompt_sampling import sampling_for
from workers.batch.stopping import StopWatch
from workers.batch.units import EngineDown, Unit, gather_or_cancel, units
from workers.dataset.jobs import JobSpec, PromptRow
from workers.dataset.samples import parse_unit_key
from workers.delivery.crashes import CrashTracker
from workers.delivery.gpu_share import GpuShare
from workers.delivery.ownership import Ownership
from workers.delivery.progress import BatchEnv, ProgressRecorder, result_row
from workers.engine.client import Completion, EngineClient
from workers.errors import EngineError, EngineUnavailable, PromptRejected
from workers.redisdb.keys import JobKeys
from workers.retry import RetryPolicy, backoff_s
from workers.split.owner import RowSplitter, live_part_rows
from workers.split.protocol import Part, share_tag

log = logging.getLogger(__name__)

SHARE_INTERVAL_S = 0.1  # well inside the time the engine's queue (the headroom) lasts
SPLIT_EVERY = 5  # share ticks between looks at a split request (half a second)
PART_POLL_S = 0.5  # the owner's look at its batch's live parts


class BatchRunner:
    """Drives one batch through the engine."""

    def __init__(self, env: BatchEnv, spec: JobSpec, batch: int, rows: list[PromptRow],
                 owner: Ownership, part: Part | None = None) -> None:
        s = env.settings
        self.env, self.spec, self.batch, self.rows, self.owner = env, spec, batch, rows, owner
        self.part = part  # a part of another GPU's batch (workers/split/)
        self.policy = RetryPolicy(s.retry_max_attempts, s.retry_base_s, s.retry_max_s)
        self.recorder = ProgressRecorder(env, spec.name, batch, owner.token, spec,
                                         fence=owner.key if part else None, rows=rows)
        self.splitter = None if part else RowSplitter(
            env.redis, spec.name, batch, owner, s.visibility_timeout_s, s.split_min_rows)
        self.crashes = CrashTracker(env.redis, spec.name, env.me.node, s.poison_crashes)
        self.client = EngineClient(f"http://{s.engine_host}:{env.me.port}",
                                   s.request_timeout_s, 1024)
        self.in_flight: set[str] = set()  # unit keys: every sample is a running request
        self.remaining = 0  # units of this run without an outcome yet: the batch's claim
        self._warm: dict[int, asyncio.Future[None]] = {}  # prompt index -> its prefill
        self.budget = 0  # requests in flight on this GPU, shared with its other batches
        self.limiter = Limiter(0)
        self.share = GpuShare(env.redis, env.me.node, share_tag(spec.name, batch, part))
        self._engine_wait: asyncio.Task[bool] | None = None
        self._crash_restarts = 0
        self._blame_all = True  # in isolation only a lone suspect is blamed for a crash
        self.stops = StopWatch(env, spec.name, batch, owner)
        self.sent = 0

    def __repr__(self) -> str:
        return f"<BatchRunner {self.spec.name}/{self.batch} rows={len(self.rows)} sent={self.sent}>"

    # --- the engine going away ---------------------------------------------------------
    async def _poll_engine(self) -> bool:
        """Wait until healthy; True if the engine crashed (and was restarted) meanwhile."""
        suspects = sorted({parse_unit_key(k)[0] for k in self.in_flight})
        end = time.monotonic() + self.env.settings.engine_wait_s
        # A probe that hangs (a port held by something that never answers) must not stretch
        # the wait: each probe gets at most what is left of it.
        while not await self.client.healthy(min(20.0, max(end - time.monotonic(), 1.0))):
            if time.monotonic() > end:
                raise EngineDown(f"engine on GPU {self.env.me.gpu} down for "
                                 f"{self.env.settings.engine_wait_s:.0f} s")
            await asyncio.sleep(1.0)
        restarts = await self.crashes.crash_restarts()
        crashed, self._crash_restarts = restarts > self._crash_restarts, restarts
        # A lone suspect is blamed only if it ran alone on the engine: with another batch's
        # requests in flight the crash may be theirs.
        alone = len(suspects) == 1 and self.share.others_in_flight == 0
        if crashed and (self._blame_all or alone):
            await self.crashes.add(suspects)
        if self.budget:
            # The engine may be back with another cap (a relaunch with a new profile).
            self.budget = await self._concurrency()
        if crashed:
            self._warm.clear()  # a restarted engine's cache is empty: prefill again
            log.warning("engine on GPU %d crashed with %d prompts of batch %d in flight",
                        self.env.me.gpu, len(suspects), self.batch)
        return crashed

    async def _wait_for_engine(self) -> bool:
        """Shared by all requests of this batch: wait for /health; True after a crash."""
        if self._engine_wait is None or self._engine_wait.done():
            self._engine_wait = asyncio.ensure_future(self._poll_engine())
        return await asyncio.shield(self._engine_wait)

    # --- one prompt ---------------------------------------------------------------------
    async def _prefill_once(self, unit: Unit) -> None:
        """Prefill a prompt of several samples once before they go (see the module
        docstring); its samples wait for it. A failed prefill is only a lost saving: each
        sample's own request meets the same error and handles it."""
        fut = self._warm.get(unit.index)
        if fut is None:
            row = unit.row
            fut = asyncio.ensure_future(self.client.prefill(
                row.prompt, row.messages, sampling_for(self.spec, row, 0)))
            self._warm[unit.index] = fut
        try:
            await asyncio.shield(fut)
        except (EngineError, OSError):
            pass

    async def _attempt(self, unit: Unit) -> Completion | str | EngineUnavailable:
        """A completion, a rejection reason (quarantine), or the engine error to handle."""
        await self.owner.confirm(self.env.settings.lease_renew_s)
        self.sent += 1
        row = unit.row
        try:
            if unit.samples > 1:
                await self._prefill_once(unit)
            return await self.client.complete(row.prompt, row.messages,
                                              sampling_for(self.spec, row, unit.sample))
        except PromptRejected as exc:
            return str(exc)
        except EngineUnavailable as exc:
            return exc

    async def _one(self, unit: Unit, sem: Limiter) -> bool:
        """Send one sample until it has an outcome; False if a crash made it a suspect."""
        async with sem:
            if self.splitter is not None and not self.splitter.take(unit.key):
                return True  # moved to a part: its worker sends it
            self.in_flight.add(unit.key)
            try:
                return await self._until_outcome(unit)
            finally:
                self.in_flight.discard(unit.key)

    async def _until_outcome(self, row: Unit) -> bool:
        attempt = 0
        while True:
            got = await self._attempt(row)
            if isinstance(got, Completion | str):
                self._record(row, got if isinstance(got, Completion) else None,
                             got if isinstance(got, str) else None)
                return True
            if not await self.client.healthy():
                if await self._wait_for_engine():
                    return False
                continue
            attempt += 1
            limit = min(self.policy.max_attempts, got.max_attempts or self.policy.max_attempts)
            if attempt >= limit:
                self._record(row, None, f"gave up after {attempt} attempts: {got}")
                return True
            await asyncio.sleep(backoff_s(attempt, self.policy))

    def _record(self, unit: Unit, done: Completion | None, error: str | None) -> None:
        self.recorder.add(result_row(self.spec, self.batch, unit.row, self.env, done, error,
                                     unit.sample))
        self.remaining -= 1

    # --- phases -------------------------------------------------------------------------
    async def _concurrency(self) -> int:
        """Requests in flight: the setting, the profile's, or the engine's cap with headroom."""
        s = self.env.settings
        fixed = s.client_concurrency or self.env.profile_concurrency
        if fixed:
            return fixed
        cap = await self.client.running_cap() or 64
        return math.ceil(cap * s.client_headroom) + 1

    async def _send(self, rows: list[Unit], sem: Limiter) -> list[Unit]:
        """Send units within ``sem``; return those set aside by a crash."""
        outcomes = await gather_or_cancel([self._one(row, sem) for row in rows])
        return [row for row, ok in zip(rows, outcomes, strict=True) if not ok]

    async def _quarantine_poisoned(self, rows: list[Unit]) -> list[Unit]:
        counts = await self.crashes.counts(sorted({r.index for r in rows}))
        keep = []
        for row in rows:
            if counts[row.index] >= self.crashes.threshold:
                self._record(row, None, f"poison prompt: the engine crashed {counts[row.index]} "
                                        "times while it was in flight")
            else:
                keep.append(row)
        return keep

    async def _isolate(self, suspects: list[Unit]) -> None:
        """Bisect suspects: send a group; if the engine crashes again, split what is left.
        Each group runs with the engine to itself (the GPU's other batches wait), so a crash
        is blamed on this batch's prompts only when they caused it."""
        self._blame_all = False
        groups = [suspects] if suspects else []
        self.share.exclusive = bool(groups)
        try:
            while groups:
                group = await self._quarantine_poisoned(groups.pop())
                if not group:
                    continue
                await self._wait_alone()
                left = await self._send(group, Limiter(len(group)))
                await self.recorder.flush()
                if len(left) > 1:
                    groups += [left[len(left) // 2:], left[: len(left) // 2]]
                elif left:
                    groups.append(left)
        finally:
            self.share.exclusive = False

    async def _wait_alone(self) -> None:
        """Until the GPU's other batches have nothing in flight and none isolates before us."""
        while True:
            try:
                mine = await self.share.exchange(self.remaining, len(self.in_flight), 1)
            except (RedisError, OSError):
                return  # no exchange: isolate anyway (blame stays conservative)
            if mine and self.share.others_in_flight == 0:
                return
            await asyncio.sleep(SHARE_INTERVAL_S)

    async def _pending_rows(self) -> tuple[list[Unit], bool]:
        """The units without an outcome this run sends now, and whether a live part of the
        batch holds others (then the run waits for it)."""
        keys = JobKeys(self.spec.name)
        have = set(await self.env.redis.hkeys(keys.progress(self.batch)))
        deaths = int(await self.env.redis.hget(keys.child_deaths, self.batch) or 0)
        limit = self.env.settings.batch_child_deaths
        held = (frozenset() if self.part else
                await live_part_rows(self.env.redis, self.spec.name, self.batch))
        todo, parted = [], False
        for row in units(self.spec, self.rows):
            if row.key.encode() in have or (self.part and row.key not in self.part.rows):
                continue
            if row.key in held:
                parted = True
            elif row.error:
                self._record(row, None, row.error)
            elif deaths >= limit:
                self._record(row, None, f"poison batch: the worker process running it died "
                                        f"{deaths} times (killed or crashed); quarantined")
            else:
                todo.append(row)
        await self.recorder.flush()
        return todo, parted

    async def _generate(self, todo: list[Unit]) -> None:
        self._crash_restarts = await self.crashes.crash_restarts()
        counts = await self.crashes.counts(sorted({r.index for r in todo}))
        fresh = [r for r in todo if counts[r.index] == 0]
        suspects = [r for r in todo if counts[r.index] > 0]
        self.remaining = len(todo)
        await self._take_share()  # claim the GPU before any request is sent
        flusher = asyncio.ensure_future(self.recorder.run_flusher())
        sharer = asyncio.ensure_future(self._share_gpu())
        try:
            await self.stops.run(self._phases(fresh, suspects))
        finally:
            background = [t for t in (flusher, sharer, self._engine_wait) if t is not None]
            await cancel_and_wait(*background)
            await self._final_flush()
            await self.share.leave()

    async def _final_flush(self) -> None:
        """Write what is buffered, retrying a failing Redis for up to the lease."""
        deadline = time.monotonic() + self.env.settings.visibility_timeout_s
        while True:
            try:
                return await self.recorder.flush()
            except (RedisError, OSError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)

    async def _take_share(self) -> None:
        """Publish this batch's claim on the GPU's budget and set the limit to its share."""
        try:
            share = await self.share.exchange(self.remaining, len(self.in_flight), self.budget)
        except (RedisError, OSError) as exc:
            log.debug("GPU share not exchanged (%s): using the whole budget", exc)
            share = self.budget  # sending too much only queues in the engine; too little stalls
        await self.limiter.set_limit(share)

    async def _share_gpu(self) -> None:
        ticks = 0
        while True:
            await self._take_share()
            ticks += 1
            if self.splitter is not None and ticks % SPLIT_EVERY == 0:
                self.remaining -= await self.splitter.answer(len(self.in_flight),
                                                             self.share.exclusive)
            await asyncio.sleep(SHARE_INTERVAL_S)

    async def _phases(self, fresh: list[Unit], suspects: list[Unit]) -> None:
        if self.splitter is not None:
            self.splitter.begin(u.key for u in fresh)
        if fresh:
            await self._wait_for_engine()
            self.budget = await self._concurrency()
            await self._take_share()
            suspects += await self._send(fresh, self.limiter)
        await self._isolate(suspects)

    async def _answer_every_row(self) -> None:
        """Generate every missing row, waiting while a live part holds some. Rows lost from
        Redis mid-batch (a restart) or given back by a lapsed part show up as missing again:
        up to three passes send them."""
        passes, waited = 0, False
        try:
            while passes < 3:
                await self.owner.confirm(self.env.settings.lease_renew_s)
                todo, parted = await self._pending_rows()
                if todo:
                    passes += 1
                    await self._generate(todo)
                elif parted:
                    waited = True
                    await self.stops.run(self._wait_for_parts())
                else:
                    return
        finally:
            if waited:
                await self.share.leave()

    async def _wait_for_parts(self) -> None:
        """One look's wait for the batch's live parts. The batch's claim says it sends
        nothing meanwhile, so its worker takes another batch (workers/delivery/hold.py)."""
        self.remaining = 0
        await self._take_share()
        await asyncio.sleep(PART_POLL_S)

    async def run(self) -> dict[str, Any]:
        """Generate every missing row, then write the batch's results; returns a summary."""
        t0 = time.monotonic()
        try:
            await self._answer_every_row()
        finally:
            await self.client.aclose()
        if self.part is not None:  # its rows are the batch owner's to write
            return {"job": self.spec.name, "batch": self.batch, "part": self.part.id,
                    "rows": len(self.part.rows), "sent": self.sent,
                    "seconds": round(time.monotonic() - t0, 3)}
        rows = await results.finish(self.env, self.spec, self.batch, self.rows, self.owner)
        return self._summary(rows, time.monotonic() - t0)

    def _summary(self, rows: list[dict[str, Any]], secs: float) -> dict[str, Any]:
        tokens = sum(r["completion_tokens"] for r in rows)
        failed = sum(r["status"] == "failed" for r in rows)
        log.info("batch %s/%d gpu=%d prompts=%d sent=%d failed=%d tokens=%d secs=%.1f tok/s=%.0f",
                 self.spec.name, self.batch, self.env.me.gpu, len(rows), self.sent, failed,
                 tokens, secs, tokens / max(secs, 1e-9))
        return {"job": self.spec.name, "batch": self.batch, "rows": len(rows), "sent": self.sent,
                "failed": failed, "output_tokens": tokens, "seconds": round(secs, 3)}
