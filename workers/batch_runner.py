"""Run one batch against the local engine: concurrent requests, durable progress, results.

Prompts already answered (the batch's progress hash in Redis) are not sent again, so a
redelivered batch or a restarted engine only costs the prompts that were in flight. Per-prompt
errors become failed rows with a reason; an engine that stays down hands the batch back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from config.settings import Settings
from workers import jobstate
from workers.context import WorkerIdentity
from workers.engine_client import Completion, EngineClient, Sampling
from workers.errors import EngineError, EngineUnavailable, PromptRejected, StoreError
from workers.jobs import JobSpec, PromptRow, encode_rows, result_key
from workers.retry import RetryPolicy, backoff_s
from workers.store import Store

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.5


class EngineDown(EngineError):
    """The engine did not come back within the wait: the batch goes back to the queue."""


@dataclass
class BatchEnv:
    """What a batch run needs from its worker."""

    settings: Settings
    me: WorkerIdentity
    store: Store
    redis: aioredis.Redis
    profile: str


def result_row(spec: JobSpec, batch: int, row: PromptRow, env: BatchEnv,
               done: Completion | None, error: str | None) -> dict[str, Any]:
    """The stored form of one prompt's outcome."""
    return {
        "job": spec.name, "batch": batch, "index": row.index, "id": row.id,
        "prompt": row.prompt, "messages": row.messages,
        "completion": done.text if done else None,
        "reasoning": done.reasoning if done else None,
        "finish_reason": done.finish_reason if done else None,
        "prompt_tokens": done.prompt_tokens if done else 0,
        "completion_tokens": done.completion_tokens if done else 0,
        "latency_s": round(done.latency_s, 4) if done else None,
        "status": "ok" if done else "failed", "error": error,
        "profile": env.profile, "gpu": env.me.gpu, "node": env.me.node,
    }


def row_kind(result: dict[str, Any]) -> str:
    """Counter bucket of a result row: ok, truncated or failed."""
    if result["status"] == "failed":
        return "failed"
    return "truncated" if result["finish_reason"] == "length" else "ok"


class ProgressRecorder:
    """Buffers finished rows and writes them to the batch's progress hash in one Lua call."""

    def __init__(self, env: BatchEnv, job: str, batch: int) -> None:
        self._env, self._batch = env, batch
        self._keys = jobstate.Keys(job)
        self._buf: list[tuple[int, bytes, str, int]] = []
        self._script = env.redis.register_script(jobstate.RECORD_ROWS)

    def add(self, result: dict[str, Any]) -> None:
        """Queue one finished row for the next flush."""
        self._buf.append(
            (result["index"], orjson.dumps(result), row_kind(result), result["completion_tokens"])
        )

    async def flush(self) -> None:
        """Write buffered rows (counted once each, whatever happens to the batch later)."""
        if not self._buf:
            return
        rows, self._buf = self._buf, []
        k = self._keys
        await self._script(
            keys=[k.progress(self._batch), k.stats, k.done, k.series_n, k.series_tok,
                  jobstate.node_stats_key(self._env.me.node)],
            args=jobstate.record_args(self._batch, self._env.me.node, rows),
        )

    async def run_flusher(self) -> None:
        """Flush every FLUSH_INTERVAL_S until cancelled."""
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            await self.flush()


async def gather_or_cancel(aws: list[Awaitable[None]]) -> None:
    """Run all; on the first exception cancel the others and re-raise it."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class BatchRunner:
    """Drives one batch through the engine."""

    def __init__(self, env: BatchEnv, spec: JobSpec, batch: int, rows: list[PromptRow]) -> None:
        s = env.settings
        self.env, self.spec, self.batch, self.rows = env, spec, batch, rows
        self.policy = RetryPolicy(s.retry_max_attempts, s.retry_base_s, s.retry_max_s)
        self.recorder = ProgressRecorder(env, spec.name, batch)
        self.client: EngineClient | None = None
        self._engine_wait: asyncio.Task[None] | None = None
        self.sent = 0

    def __repr__(self) -> str:
        return f"<BatchRunner {self.spec.name}/{self.batch} rows={len(self.rows)} sent={self.sent}>"

    async def _concurrency(self, client: EngineClient) -> int:
        s = self.env.settings
        if s.client_concurrency:
            return s.client_concurrency
        await self._wait_for_engine()
        cap = await client.running_cap() or 64
        return math.ceil(cap * s.client_headroom) + 1

    async def _poll_engine(self, deadline_s: float) -> None:
        assert self.client is not None
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if await self.client.healthy():
                return
            await asyncio.sleep(1.0)
        raise EngineDown(f"engine on GPU {self.env.me.gpu} down for {deadline_s:.0f} s")

    async def _wait_for_engine(self) -> None:
        """Wait (shared by all requests) until the engine answers /health again."""
        if self._engine_wait is None or self._engine_wait.done():
            self._engine_wait = asyncio.ensure_future(
                self._poll_engine(self.env.settings.engine_wait_s)
            )
        await asyncio.shield(self._engine_wait)

    def _sampling(self, row: PromptRow) -> Sampling:
        js = self.spec.sampling
        extra = {k: v for k, v in row.params.items()
                 if k not in ("max_tokens", "max_new_tokens", "temperature", "top_p")}
        return Sampling(
            max_new_tokens=row.params.get("max_tokens", row.params.get("max_new_tokens",
                                                                       js.max_new_tokens)),
            temperature=row.params.get("temperature", js.temperature),
            top_p=row.params.get("top_p", js.top_p),
            extra=extra or None,
        )

    async def _one(self, row: PromptRow, sem: asyncio.Semaphore) -> None:
        assert self.client is not None
        async with sem:
            attempt = 0
            while True:
                try:
                    self.sent += 1
                    done = await self.client.complete(row.prompt, row.messages, self._sampling(row))
                except PromptRejected as exc:
                    self._record(row, None, str(exc))
                    return
                except EngineUnavailable as exc:
                    attempt += 1
                    if await self.client.healthy():
                        if attempt >= self.policy.max_attempts:
                            self._record(row, None, f"gave up after {attempt} attempts: {exc}")
                            return
                        await asyncio.sleep(backoff_s(attempt, self.policy))
                    else:
                        await self._wait_for_engine()
                    continue
                self._record(row, done, None)
                return

    def _record(self, row: PromptRow, done: Completion | None, error: str | None) -> None:
        self.recorder.add(result_row(self.spec, self.batch, row, self.env, done, error))

    async def _pending_rows(self) -> list[PromptRow]:
        keys = jobstate.Keys(self.spec.name)
        have = set(await self.env.redis.hkeys(keys.progress(self.batch)))
        todo = []
        for row in self.rows:
            if str(row.index).encode() in have:
                continue
            if row.error:
                self._record(row, None, row.error)
            else:
                todo.append(row)
        return todo

    async def _generate(self, todo: list[PromptRow]) -> None:
        s = self.env.settings
        self.client = EngineClient(
            f"http://{s.engine_host}:{self.env.me.port}", s.request_timeout_s, 1024
        )
        flusher = asyncio.ensure_future(self.recorder.run_flusher())
        try:
            sem = asyncio.Semaphore(await self._concurrency(self.client))
            await gather_or_cancel([self._one(row, sem) for row in todo])
        finally:
            flusher.cancel()
            await self.recorder.flush()
            await self.client.aclose()

    async def run(self) -> dict[str, Any]:
        """Generate every missing row, then write the batch's results; returns a summary."""
        t0 = time.monotonic()
        keys = jobstate.Keys(self.spec.name)
        await self.env.redis.hset(keys.running, self.batch, self.env.me.node)
        # Rows lost from Redis mid-batch (a restart) show up as missing again: run them too.
        for _ in range(3):
            todo = await self._pending_rows()
            await self.recorder.flush()
            if not todo:
                break
            await self._generate(todo)
        rows = await self._collect()
        await self._write_results(rows)
        await self.env.redis.register_script(jobstate.FINISH_BATCH)(
            keys=[keys.done, keys.pending, keys.running, keys.progress(self.batch)],
            args=[self.batch],
        )
        tokens = sum(r["completion_tokens"] for r in rows)
        secs = time.monotonic() - t0
        log.info("batch %s/%d gpu=%d prompts=%d sent=%d failed=%d tokens=%d secs=%.1f tok/s=%.0f",
                 self.spec.name, self.batch, self.env.me.gpu, len(rows), self.sent,
                 sum(r["status"] == "failed" for r in rows), tokens, secs, tokens / max(secs, 1e-9))
        return {"job": self.spec.name, "batch": self.batch, "rows": len(rows), "sent": self.sent,
                "output_tokens": tokens, "seconds": round(secs, 3)}

    async def _collect(self) -> list[dict[str, Any]]:
        raw = await self.env.redis.hgetall(jobstate.Keys(self.spec.name).progress(self.batch))
        rows = sorted((orjson.loads(v) for v in raw.values()), key=lambda r: r["index"])
        expected = [r.index for r in self.rows]
        if [r["index"] for r in rows] != expected:
            missing = sorted(set(expected) - {r["index"] for r in rows})
            raise StoreError(f"batch {self.batch} progress lost rows {missing[:10]}; retrying")
        return rows

    async def _write_results(self, rows: list[dict[str, Any]]) -> None:
        """Write the batch's results, retrying a failing store with backoff."""
        data = encode_rows(rows, compress=False)
        key = result_key(self.spec.name, self.batch)
        policy = RetryPolicy(max_attempts=10, base_s=1.0, max_s=30.0)
        for attempt in range(1, policy.max_attempts + 1):
            try:
                await asyncio.to_thread(self.env.store.put, key, data)
                return
            except StoreError as exc:
                if attempt == policy.max_attempts:
                    raise
                delay = backoff_s(attempt, policy)
                log.warning("store write of %s failed (%s); retry in %.1f s", key, exc, delay)
                await asyncio.sleep(delay)
