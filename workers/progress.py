"""Per-prompt progress of a batch: result rows and the Lua call that records them in Redis."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from config.settings import Settings
from workers import jobstate
from workers.context import WorkerIdentity
from workers.engine_client import Completion
from workers.jobs import JobSpec, PromptRow
from workers.store import Store

FLUSH_INTERVAL_S = 0.5


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
