"""Finding 1: Redis ``used_memory_peak`` at the peak of a running job with real-sized rows.

The job is shaped like the real one: 1M prompts queued (a real ``python -m producer enqueue``
of 1M short prompts into the bench's Redis), 7 GPU workers with 2 batches of 500 prompts each
taken, thinking-mode rows (about 10 KB of reasoning, 2 KB of answer, 1 KB of prompt). What is
*simulated* is the workers' schedule, not the writes: a seeded event model of each GPU (40
running slots, the shared in-flight budget ``ceil(40 x 1.25) + 1`` oldest batch first,
log-normal output lengths, 87.5 tokens/s per request, answered rows spilled every
``SPILL_INTERVAL_S``, the batch's results stored 1 s after its last answer) says which rows
are answered when, and the rows are written in that order through the real path: a chunk of
rows into a local store (``workers.delivery.progress.spill_rows``) and the chunk's name per
answered index through ``workers.redisdb.scripts.record_rows``, as
``ProgressRecorder.flush`` does, owner token included; the batch is finished with
``FINISH_BATCH`` (which deletes its progress hash) and its chunks dropped, as the batch runner
does.
No time is slept: only the order matters for memory. The same schedule is replayed with rows
of each size given, so the growth with the row size is read off directly.

    python -m bench.redis_peak [--queued 1000000] [--gpus 7] [--row-kb 12 100]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import orjson
import redis

from bench.common import (
    WORKLOAD_MAX_NEW_TOKENS,
    Goal,
    local_fleet,
    note,
    verdict,
    write_chat_prompts,
)
from workers.dataset.jobs import PromptRow
from workers.dataset.store import Store, open_store
from workers.delivery.progress import SPILL_INTERVAL_S, drop_progress, result_row, spill_rows
from workers.engine.client import Completion
from workers.redisdb import scripts
from workers.redisdb.keys import JobKeys

REDIS_GOAL_MB = 50.0
FLAT_GOAL = 1.10  # peak at the largest rows / peak at the smallest: "flat"
CAP = 40  # qwen36-27b's effective running cap (bench.engines.planned_engine_model)
BUDGET = math.ceil(CAP * 1.25) + 1  # workers.delivery.gpu_share: one in-flight budget per GPU
TOKENS_PER_S = 3.5 / 0.040  # one request's decode rate: accept length 3.5 per 40 ms step
MEAN_TOKENS, SIGMA = 2490, 0.8
STORE_LAG_S = 1.0  # last answer -> results stored -> FINISH_BATCH
BATCH = 500
SLOTS = 2  # batches a GPU worker holds (its own + the one prefetched)


@dataclass(order=True)
class _Event:
    t: float
    kind: str = field(compare=False)  # "answer" or "finish"
    gpu: int = field(compare=False)
    batch: int = field(compare=False)
    index: int = field(compare=False, default=-1)


def schedule(gpus: int, batches_per_gpu: int, seed: int = 1) -> list[_Event]:
    """Answers and batch finishes of every GPU, in time order (see the module docstring)."""
    rng = random.Random(seed)
    mu = math.log(MEAN_TOKENS) - SIGMA * SIGMA / 2
    events: list[_Event] = []
    next_batch = 0
    for gpu in range(gpus):
        held = list(range(next_batch, next_batch + SLOTS))
        queue = list(range(next_batch + SLOTS, next_batch + batches_per_gpu))
        next_batch += batches_per_gpu
        unsent = {b: list(range(BATCH)) for b in held}
        answered = {b: 0 for b in held}
        running: list[tuple[float, int, int]] = []  # (t done, batch, index)
        t = 0.0
        while held:
            # Oldest batch first: fill the budget (the engine runs CAP of them, the rest wait;
            # waiting only delays, so CAP running is what is modelled).
            for b in sorted(held):
                while unsent[b] and len(running) < CAP:
                    tokens = min(rng.lognormvariate(mu, SIGMA), WORKLOAD_MAX_NEW_TOKENS)
                    heapq.heappush(running, (t + tokens / TOKENS_PER_S, b, unsent[b].pop(0)))
            t, b, i = heapq.heappop(running)
            events.append(_Event(t, "answer", gpu, b, i))
            answered[b] += 1
            if answered[b] == BATCH:
                events.append(_Event(t + STORE_LAG_S, "finish", gpu, b))
                held.remove(b)
                if queue:
                    nb = queue.pop(0)
                    held.append(nb)
                    unsent[nb], answered[nb] = list(range(BATCH)), 0
    return sorted(events)


def _words(rng: random.Random, n_bytes: int) -> str:
    letters = "etaoinshrdlucmfwypvbgkjqxz "
    return "".join(rng.choices(letters, k=n_bytes))


def row_bytes(row_kb: float, rng: random.Random, batch: int, index: int) -> bytes:
    """A thinking-mode result row, as result_row stores it: ``row_kb`` KB of output split 5:1
    between reasoning and answer (10 KB + 2 KB at 12 KB), plus a 1 KB prompt and the row's
    other fields (ids, tokens, node, launch digest)."""
    body = int(row_kb * 1024)
    reasoning, answer = body * 5 // 6, body // 6
    env = SimpleNamespace(profile="qwen36-27b", launch_digest="d" * 16,
                          me=SimpleNamespace(gpu=batch % 7, node=f"gpu{batch % 7}@bench"))
    prompt = PromptRow(index=index, id=f"q{index}",
                       messages=[{"role": "user", "content": _words(rng, 1000)}])
    done = Completion(text=_words(rng, answer), reasoning=_words(rng, reasoning),
                      finish_reason="stop", prompt_tokens=250, completion_tokens=3000,
                      latency_s=30.0)
    spec = SimpleNamespace(name="peak")
    return orjson.dumps(result_row(spec, batch, prompt, env, done, None))  # type: ignore[arg-type]


def replay(r: redis.Redis, store: Store, job: str, events: list[_Event],
           row_kb: float) -> tuple[float, int]:
    """Write the schedule's rows as the workers do (chunks in the store, their names through
    ``scripts.record_rows``, then ``scripts.finish_batch``); (peak MiB, peak rows answered and
    not yet stored)."""
    keys = JobKeys(job)
    rng = random.Random(7)
    # A pool of distinct rows (reused across batches: Redis stores each copy anyway).
    pool = [row_bytes(row_kb, rng, 0, i) for i in range(64)]
    r.memory_purge()
    pending: dict[tuple[int, int], list[tuple[int, bytes, str, int]]] = {}
    live_rows, peak_rows, next_flush, seq = 0, 0, SPILL_INTERVAL_S, 0

    def flush() -> None:
        nonlocal seq
        for (gpu, b), rows in pending.items():
            node = f"gpu{gpu}@bench"
            chunk = spill_rows(store, job, b, f"tok{b}-{seq:06d}", [x[1] for x in rows])
            seq += 1
            refs = [(index, chunk.encode(), kind, tok) for index, _, kind, tok in rows]
            scripts.record_rows(r, job, b, node, f"tok{b}", refs)
        pending.clear()

    owned: set[int] = set()
    for ev in events:
        while ev.t >= next_flush:
            flush()
            next_flush += SPILL_INTERVAL_S
        if ev.batch not in owned:
            r.set(keys.owner(ev.batch), f"tok{ev.batch}")
            owned.add(ev.batch)
        if ev.kind == "answer":
            pending.setdefault((ev.gpu, ev.batch), []).append(
                (ev.index, pool[ev.index % len(pool)], "ok", 3000))
            live_rows += 1
            peak_rows = max(peak_rows, live_rows)
        else:
            flush()
            scripts.finish_batch(r, job, ev.batch, f"tok{ev.batch}")
            drop_progress(store, job, ev.batch)
            live_rows -= BATCH
    flush()
    return r.info("memory")["used_memory_peak"] / 2**20, peak_rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 when a goal is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--queued", type=int, default=1_000_000)
    parser.add_argument("--gpus", type=int, default=7)
    parser.add_argument("--batches-per-gpu", type=int, default=4)
    parser.add_argument("--row-kb", type=float, nargs="+", default=[12.0, 100.0])
    args = parser.parse_args(argv)
    events = schedule(args.gpus, args.batches_per_gpu)
    with local_fleet("redis-peak") as fleet:
        path = write_chat_prompts(fleet.workdir / "queued.jsonl", args.queued)
        fleet.producer("enqueue", str(path), "--job", "queued")
        path.unlink()
        queued_mb = fleet.r.info("memory")["used_memory"] / 2**20
        note(f"{args.queued:,} prompts queued: used_memory {queued_mb:.1f} MiB "
             f"({fleet.r.llen('gpu'):,} messages)")
        peaks: dict[float, float] = {}
        for kb in sorted(args.row_kb):  # used_memory_peak only grows: smallest first
            peak_mb, rows = replay(fleet.r, open_store(fleet.workdir.as_uri(), None),
                                   f"peak{int(kb)}", events, kb)
            size = len(row_bytes(kb, random.Random(1), 0, 0))
            peaks[kb] = peak_mb
            note(f"{kb:.0f} KB outputs, rows of {size / 1024:.1f} KB: used_memory_peak "
                 f"{peak_mb:.1f} MiB; at most "
                 f"{rows:,} answered rows waited for their batch ({rows / args.gpus:.0f} "
                 f"per GPU; {rows * size / 2**20:.0f} MiB of rows, in store chunks: Redis "
                 f"holds a chunk name per row) + {queued_mb:.1f} MiB queued")
    small, large = min(args.row_kb), max(args.row_kb)
    return verdict("bench.redis_peak (finding 1)", [
        Goal(f"used_memory_peak, {small:.0f} KB outputs, {args.gpus} GPUs x {SLOTS} x {BATCH}",
             peaks[small], REDIS_GOAL_MB, "MiB", at_most=True),
        Goal(f"used_memory_peak, {large:.0f} KB outputs", peaks[large], REDIS_GOAL_MB, "MiB",
             at_most=True),
        Goal(f"flat: peak at {large:.0f} KB / at {small:.0f} KB outputs",
             peaks[large] / peaks[small], FLAT_GOAL, at_most=True),
    ])


if __name__ == "__main__":
    sys.exit(main())
