"""Per-prompt progress of a batch: result rows and the Lua call that records them in Redis."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from config.settings import Settings
from workers import jobstate
from workers.context import WorkerIdentity
from workers.delivery.ownership import LostOwnership
from workers.engine_client import Completion
from workers.jobs import JobSpec, PromptRow
from workers.manifest import row_bucket
from workers.metrics import node_prompts_key
from workers.store import Store

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.5
# Told (rows, output tokens) after each flush: the task's Flower progress events.
ProgressHook = Callable[[int, int], Awaitable[None]]


@dataclass
class BatchEnv:
    """What a batch run needs from its worker."""

    settings: Settings
    me: WorkerIdentity
    store: Store
    redis: aioredis.Redis
    profile: str
    # Client concurrency fixed by the engine's launch profile (None: derive from its cap).
    profile_concurrency: int | None = None
    on_progress: ProgressHook | None = None
    # workers.manifest.launch_digest of the engine's launch profile (from its heartbeat).
    launch_digest: str | None = None


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
        "launch_digest": env.launch_digest,
    }


class ProgressRecorder:
    """Buffers finished rows; writes them to the batch's progress hash, one Lua call per kind,
    as the batch's owner (``token``)."""

    def __init__(self, env: BatchEnv, job: str, batch: int, token: str) -> None:
        self._env, self._batch, self._token = env, batch, token
        self._keys = jobstate.Keys(job)
        # Rows by manifest bucket (ok/truncated/failed/quarantined), flushed one bucket per call.
        self._buf: dict[str, list[tuple[int, bytes, str, int]]] = {}
        self._script = env.redis.register_script(jobstate.RECORD_ROWS)

    def add(self, result: dict[str, Any]) -> None:
        """Queue one finished row for the next flush."""
        kind = row_bucket(result)
        self._buf.setdefault(kind, []).append(
            (result["index"], orjson.dumps(result), kind, result["completion_tokens"]))

    def _put_back(self, groups: dict[str, list[tuple[int, bytes, str, int]]]) -> None:
        for kind, rows in groups.items():
            self._buf.setdefault(kind, [])[:0] = rows

    async def flush(self) -> None:
        """Write buffered rows (counted once each, whatever happens to the batch later).

        Rows whose write fails stay buffered for the next flush; LostOwnership if another run
        owns the batch now (its rows are kept by that run)."""
        if not self._buf:
            return
        groups, self._buf = self._buf, {}
        k, node = self._keys, self._env.me.node
        keys = [k.progress(self._batch), k.stats, k.done, k.series_n, k.series_tok,
                jobstate.node_stats_key(node), k.owner(self._batch), k.bstats]
        fresh: dict[str, int] = {}
        written: list[str] = []
        try:
            for kind, rows in groups.items():  # the script's count per bucket: exact per kind
                n = await self._script(
                    keys=keys, args=jobstate.record_args(self._batch, node, self._token, rows))
                if n < 0:
                    raise LostOwnership(f"batch {self._batch} is owned by another run")
                fresh[kind] = n
                written.append(kind)
        except (RedisError, OSError):
            self._put_back({kind: rows for kind, rows in groups.items() if kind not in written})
            raise
        finally:
            await self._after(fresh, groups, written)

    async def _after(self, fresh: dict[str, int],
                     groups: dict[str, list[tuple[int, bytes, str, int]]],
                     written: list[str]) -> None:
        if not written:
            return
        try:
            await self._count(fresh)
        except (RedisError, OSError):
            pass  # per-worker metrics only; the job's counters were bumped with the rows
        if self._env.on_progress is not None:
            flushed = [row for kind in written for row in groups[kind]]
            await self._env.on_progress(len(flushed), sum(row[3] for row in flushed))

    async def _count(self, fresh: dict[str, int]) -> None:
        """Per-worker prompts by kind (metrics)."""
        async with self._env.redis.pipeline(transaction=False) as pipe:
            for kind, n in fresh.items():
                if n:
                    pipe.hincrby(node_prompts_key(self._env.me.node), kind, n)
            await pipe.execute()

    async def run_flusher(self) -> None:
        """Flush every FLUSH_INTERVAL_S until cancelled; a failed write is retried next time
        (the rows stay buffered), so one Redis hiccup neither drops rows nor ends the flusher."""
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            try:
                await self.flush()
            except (RedisError, OSError) as exc:
                log.warning("progress flush of batch %d failed (kept for the next): %s",
                            self._batch, exc)
