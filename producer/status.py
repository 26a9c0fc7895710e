"""Live job status from Redis: progress, rate, ETA and the per-worker view of the fleet (each
worker's heartbeat: its GPU or GPU group, ``gpus`` and ``tp_size``, engine state, load)."""

from __future__ import annotations

import time
from typing import Any

import redis

from workers.dataset.jobs import JobSpec, load_spec
from workers.dataset.location import StoreLocation
from workers.dataset.store import Store
from workers.delivery import job_progress, jobstate
from workers.delivery.ownership import live_holders
from workers.errors import JobError
from workers.node.heartbeat import read_heartbeats
from workers.redisdb.keys import SERIES_BUCKET_S, JobKeys, bucket

RATE_WINDOW_S = 60


def status_spec(store: Store, r: redis.Redis, job: str) -> JobSpec:
    """The job's spec from its store, else the copy ``enqueue`` left in Redis: a store that
    cannot be read now still has a status, with the workers' ``stalled`` notes."""
    try:
        return load_spec(store, job)
    except JobError:
        raw = r.hget(JobKeys(job).job, "spec")
        if not raw:
            raise
        return JobSpec.model_validate_json(raw)


def _rates(r: redis.Redis, keys: JobKeys, started_at: float) -> tuple[float, float]:
    """Rows/s and output tokens/s over the last RATE_WINDOW_S seconds."""
    now = time.time()
    first = bucket(now - RATE_WINDOW_S)
    buckets = list(range(first + SERIES_BUCKET_S, bucket(now) + 1,
                         SERIES_BUCKET_S))
    pipe = r.pipeline()
    pipe.hmget(keys.series_n, buckets)
    pipe.hmget(keys.series_tok, buckets)
    n_raw, tok_raw = pipe.execute()
    rows = sum(int(v or 0) for v in n_raw)
    tokens = sum(int(v or 0) for v in tok_raw)
    span = min(now - buckets[0], max(now - started_at, 1e-3))
    span = max(span, 1e-3)
    return rows / span, tokens / span


def _prompts_done(r: redis.Redis, spec: JobSpec, keys: JobKeys) -> int:
    """Prompts of the batches stored with every sample."""
    done = {int(b) for b in r.smembers(keys.done)}
    return sum(len(spec.batch_range(b)) for b in done if 0 <= b < spec.n_batches)


def _read_at(beat: dict[str, Any]) -> float:
    """When the beat's load was read: the engine sample's time (a beat carries the last one,
    up to an interval old), else the beat's own."""
    sent = float(beat.get("updated_at") or 0)
    read = beat.get("engine_read_at")
    return min(sent, float(read)) if read is not None else sent


def _workers_after(beats: list[dict[str, Any]], end: float | None) -> list[dict[str, Any]]:
    """Heartbeats for a job that is done: a beat whose load was read before its last row was
    recorded still shows the batches, requests and tokens/s of the end; its load columns are
    left unknown (``-``) rather than show batches running and a queue for a finished job."""
    if end is None:
        return beats
    return [b if _read_at(b) > end
            else {**b, "running": None, "queued": None, "batches_running": None,
                  "tokens_per_sec": None, "stale": True}
            for b in beats]


def _quality(r: redis.Redis, spec: JobSpec, failed: list[str] | None, early_rows: int
             ) -> dict[str, Any]:
    """The job's gates, the live tally's warning while it runs, and once a data set is
    committed the gates it failed."""
    from workers.dataset.quality_gates import thresholds
    from workers.delivery.quality_live import read_live

    live = read_live(r, spec, early_rows)
    return {"thresholds": thresholds(spec.quality), "live": live, "warning": live["warning"],
            "gates_failed": failed}


def job_status(r: redis.Redis, spec: JobSpec, where: StoreLocation | None = None,
               early_rows: int = 200) -> dict[str, Any]:
    """One JSON-able object with the job's progress (keys are a contract for scripts);
    ``store`` says where the data lives (``where``: "node" or "off-node").

    While the job runs, the rates are those of the last minute; once it is done they cover
    its active span (first batch taken to last row) and ``elapsed_s`` stops at the last row."""
    keys = JobKeys(spec.name)
    p = job_progress.read(r, spec)
    c, done = p["counters"], p["done"]
    running = len(live_holders(r, spec.name))
    if done:
        span = max(p["active_s"] or p["elapsed_s"], 1e-3)
        rate, tok_rate = p["finished"] / span, c["output_tokens"] / span
    else:
        rate, tok_rate = _rates(r, keys, p["started_at"])
    # Counters count (prompt, sample) rows: with N samples per prompt, the total is every sample.
    total, finished = spec.expected_samples, p["finished"]
    remaining = max(total - finished, 0)
    eta_h = 0.0 if done else (remaining / rate / 3600 if rate > 0 else None)
    return {
        "job": spec.name, "total": total, "completed": c["completed"],
        # Progress in samples (the counters above) and in prompts: a prompt is done once its
        # batch is stored with every sample (prompts of batches still running are not).
        "samples": total, "samples_done": finished, "prompts": spec.total,
        "prompts_done": _prompts_done(r, spec, keys) if not done else spec.total,
        "failed": c["failed"], "truncated": c["truncated"],
        "quarantined": c["quarantined"], "remaining": remaining,
        "state": p["state"], "paused_by": p["paused_by"],
        "quality": _quality(r, spec, p["quality_failed"], early_rows),
        # Held by a live run; the rest of the unfinished batches wait (queued, or paused).
        "in_flight_batches": running,
        "queued_batches": max(spec.n_batches - p["done_batches"] - running, 0),
        "done_batches": p["done_batches"], "n_batches": spec.n_batches,
        # Batches split at the job's end: parts an idle GPU took, and their rows.
        "splits": p["splits"],
        "output_tokens": c["output_tokens"],
        "rate_per_sec": round(rate, 3), "tokens_per_sec": round(tok_rate, 1),
        "eta_hours": None if eta_h is None else round(eta_h, 4),
        "elapsed_s": p["elapsed_s"], "active_s": p["active_s"], "done": done,
        "dataset": p["dataset"], "dataset_version": p["dataset_version"],
        "workers": _workers_after(read_heartbeats(r), p["last_row_at"] if done else None),
        # Workers that cannot work on the job now, and why (``gpu1 cannot read job X in …``).
        "stalled": [] if done else jobstate.stalled_notes(r, spec.name),
        "store": where.to_json() if where else None,
    }
