"""Per-prompt progress of a batch: result rows, spilled to the store in chunks, and the Lua call
that records in Redis which prompts are answered (and where their rows are)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from config.settings import Settings
from workers.dataset.jobs import JobSpec, PromptRow, progress_chunk_key, progress_prefix
from workers.dataset.manifest import row_bucket
from workers.dataset.samples import row_key, row_unit
from workers.dataset.store import Store
from workers.delivery import quality_live
from workers.delivery.ownership import LostOwnership
from workers.delivery.quality_live import LiveFold
from workers.engine.client import Completion
from workers.errors import StoreError
from workers.node.context import WorkerIdentity
from workers.redisdb import scripts
from workers.redisdb.keys import NodeKeys

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.5
# Answered rows wait in memory at most this long, or until this many bytes, before they are
# written to the store as one chunk (a crash loses at most that much work); a batch of 10
# minutes writes at most ~120 chunks.
SPILL_INTERVAL_S = 5.0
SPILL_BYTES = 8 * 2**20
CHUNK_READERS = 8
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
    # workers.dataset.manifest.launch_digest of the engine's launch profile (from its heartbeat).
    launch_digest: str | None = None


def result_row(spec: JobSpec, batch: int, row: PromptRow, env: BatchEnv,
               done: Completion | None, error: str | None, sample: int = 0) -> dict[str, Any]:
    """The stored form of one (prompt, sample)'s outcome (kept input columns included)."""
    out = {
        "job": spec.name, "batch": batch, "index": row.index, "sample": sample, "id": row.id,
        "prompt": row.prompt, "messages": row.messages,
        "completion": done.text if done else None,
        "reasoning": done.reasoning if done else None,
        "finish_reason": done.finish_reason if done else None,
        "prompt_tokens": done.prompt_tokens if done else 0,
        "completion_tokens": done.completion_tokens if done else 0,
        "latency_s": round(done.latency_s, 4) if done else None,
        # As JSON text: its shape is the engine's and depends on the route and request.
        "logprobs": orjson.dumps(done.logprobs).decode()
        if done and done.logprobs is not None else None,
        "status": "ok" if done else "failed", "error": error,
        "profile": env.profile, "gpu": env.me.gpu, "node": env.me.node,
        "launch_digest": env.launch_digest,
        # As JSON text, null when the model called no tool (the chat message's tool_calls).
        "tool_calls": orjson.dumps(done.tool_calls).decode()
        if done and done.tool_calls else None,
        # The engine's own sampled token ids (null where the route returned none).
        "output_ids": done.output_ids if done else None,
        # When the outcome arrived (unix s): the report's time axis at any job length.
        "finished_at": round(time.time(), 3),
    }
    if row.keep is not None:
        out["keep"] = row.keep
    return out


def spill_rows(store: Store, job: str, batch: int, chunk: str,
               rows: list[dict[str, Any]] | list[bytes]) -> str:
    """Write answered rows of ``batch`` to the store as one chunk; return the chunk's name."""
    lines = [x if isinstance(x, bytes) else orjson.dumps(x) for x in rows]
    store.put(progress_chunk_key(job, batch, chunk), b"".join(x + b"\n" for x in lines))
    return chunk


def read_progress(store: Store, job: str, batch: int,
                  chunks: dict[tuple[int, int], str]) -> list[dict[str, Any]]:
    """The answered rows of ``batch``, in (index, sample) order: each one's row from the chunk
    that Redis recorded for it (a chunk may also hold rows another run wrote: skipped)."""
    wanted: dict[str, set[tuple[int, int]]] = {}
    for unit, chunk in chunks.items():
        wanted.setdefault(chunk, set()).add(unit)
    keys = [progress_chunk_key(job, batch, c) for c in wanted]
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=CHUNK_READERS) as pool:
        for chunk, data in zip(wanted, pool.map(store.get, keys), strict=True):
            for line in data.splitlines():
                row = orjson.loads(line)
                if (unit := row_unit(row)) in wanted[chunk]:
                    rows[unit] = row
    return [rows[u] for u in sorted(rows)]


def drop_progress(store: Store, job: str, batch: int) -> None:
    """Delete a finished batch's chunks (best effort: leftovers are only storage)."""
    try:
        for key in list(store.list(progress_prefix(job, batch))):
            store.delete(key)
    except (StoreError, OSError) as exc:
        log.warning("progress chunks of %s/%d not deleted: %s", job, batch, exc)


class ProgressRecorder:
    """Answered rows of a batch, kept out of Redis: buffered, then written to the store in
    chunks (``jobs/<job>/progress/b<batch>/``); Redis records for each answered index only the
    name of the chunk that holds its row, as the batch's owner (``token``), and counts each
    row once. Redis's share of a running batch is a few bytes per prompt whatever the size of
    its completion, and a redelivered batch still resumes from every answered prompt."""

    def __init__(self, env: BatchEnv, job: str, batch: int, token: str,
                 spec: JobSpec | None = None, fence: str | None = None,
                 rows: list[PromptRow] | None = None) -> None:
        self._env, self._job, self._batch, self._token = env, job, batch, token
        self._fence = fence  # the key that must hold ``token`` (None: the batch's owner key)
        # The job's live quality tally (workers/delivery/quality_live.py), pushed per flush.
        # ``rows``: the batch's prompts, whose own parameters may ask for structured output.
        self._quality = LiveFold(spec, [{"index": x.index, "params": x.params}
                                        for x in rows or () if x.params]
                                 ) if spec is not None else None
        self._spec = spec
        # Rows by manifest bucket (ok/truncated/failed/quarantined), recorded one bucket per call.
        self._buf: dict[str, list[tuple[str, bytes, str, int]]] = {}
        self._bytes = 0
        self._since: float | None = None
        self._chunk_tag, self._seq = token.rsplit("|", 1)[-1], 0
        self._flushing = asyncio.Lock()

    def add(self, result: dict[str, Any]) -> None:
        """Queue one finished row for the next flush."""
        kind, data = row_bucket(result), orjson.dumps(result)
        if self._quality is not None:
            self._quality.add(result)
        self._buf.setdefault(kind, []).append(
            (row_key(result), data, kind, result["completion_tokens"]))
        self._bytes += len(data)
        self._since = self._since if self._since is not None else time.monotonic()

    def due(self) -> bool:
        """Whether the buffered rows should be written now (old or big enough)."""
        if not self._buf or self._since is None:
            return False
        return self._bytes >= SPILL_BYTES or time.monotonic() - self._since >= SPILL_INTERVAL_S

    def _put_back(self, groups: dict[str, list[tuple[str, bytes, str, int]]], nbytes: int,
                  since: float | None) -> None:
        for kind, rows in groups.items():
            self._buf.setdefault(kind, [])[:0] = rows
        self._bytes += nbytes
        self._since = since if self._since is None else min(self._since, since or self._since)

    async def flush(self) -> None:
        """Write buffered rows (counted once each, whatever happens to the batch later).

        Rows whose write fails stay buffered for the next flush; LostOwnership if another run
        owns the batch now (its rows are kept by that run)."""
        async with self._flushing:  # the flusher and a forced flush never interleave
            await self._flush()

    async def _flush(self) -> None:
        if not self._buf:
            return
        groups, self._buf = self._buf, {}
        nbytes, since, self._bytes, self._since = self._bytes, self._since, 0, None
        # The chunk's name is taken before any await: a name is never written twice, so a
        # recorded index always finds its row in the chunk it names.
        name, self._seq = f"{self._chunk_tag}-{self._seq:06d}", self._seq + 1
        node = self._env.me.node
        fresh: dict[str, int] = {}
        written: list[str] = []
        try:
            chunk = await asyncio.to_thread(
                spill_rows, self._env.store, self._job, self._batch, name,
                [row[1] for rows in groups.values() for row in rows])
            for kind, rows in groups.items():  # the script's count per bucket: exact per kind
                refs = [(index, chunk.encode(), kind_, tokens)
                        for index, _, kind_, tokens in rows]
                n = await scripts.record_rows(self._env.redis, self._job, self._batch, node,
                                              self._token, refs, self._fence)
                if n < 0:
                    raise LostOwnership(f"batch {self._batch} is owned by another run")
                fresh[kind] = n
                written.append(kind)
        except LostOwnership:
            raise  # the rows are the new owner's to write
        except BaseException:  # a failed write, or a cancellation: keep what is not recorded
            left = {kind: rows for kind, rows in groups.items() if kind not in written}
            self._put_back(left, nbytes if left else 0, since)
            raise
        finally:
            await self._after(fresh, groups, written)

    async def _after(self, fresh: dict[str, int],
                     groups: dict[str, list[tuple[str, bytes, str, int]]],
                     written: list[str]) -> None:
        if not written:
            return
        try:
            await self._count(fresh)
            await self.push_quality()
        except (RedisError, OSError):
            pass  # metrics and the early warning only; the job's counters went with the rows
        if self._env.on_progress is not None:
            flushed = [row for kind in written for row in groups[kind]]
            await self._env.on_progress(len(flushed), sum(row[3] for row in flushed))

    async def push_quality(self) -> None:
        """Add the rows answered since the last push to the job's live quality tally
        (workers/delivery/quality_live.py): every FLUSH_INTERVAL_S, not only with a spill, so
        a gate the first rows break is seen within a second of them."""
        if self._quality is not None and self._spec is not None and (
                tally := self._quality.drain()) is not None:
            await quality_live.push(self._env.redis, self._spec, tally,
                                    self._env.settings.quality_early_rows)

    async def _count(self, fresh: dict[str, int]) -> None:
        """Per-worker prompts by kind (metrics)."""
        async with self._env.redis.pipeline(transaction=False) as pipe:
            for kind, n in fresh.items():
                if n:
                    pipe.hincrby(NodeKeys(self._env.me.node).prompts, kind, n)
            await pipe.execute()

    async def run_flusher(self) -> None:
        """Flush whenever rows are due until cancelled; a failed write is retried next time
        (the rows stay buffered), so one Redis or store hiccup neither drops rows nor ends the
        flusher."""
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            try:
                await self.push_quality()
            except (RedisError, OSError) as exc:
                log.warning("live quality tally of batch %d not updated: %s", self._batch, exc)
            if not self.due():
                continue
            try:
                await self.flush()
            except (RedisError, OSError, StoreError) as exc:
                log.warning("progress flush of batch %d failed (kept for the next): %s",
                            self._batch, exc)
