"""A job's progress as every view shows it (``fleet status``, ``fleet jobs``, Prometheus,
Flower): its state, its counts, the span it was active and the state of its data set.

The state an operator sets (``running``, ``paused``, ``cancelled``) lives in the job's Redis
hash; ``done`` is derived: every batch is stored and every prompt has its final row. A cancelled
job stays cancelled. Once done, ``elapsed_s`` stops at the last recorded row, and the rates
cover the active span (first batch taken to last row), so they do not decay while the finished
job sits in Redis.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import redis

from workers.dataset.jobs import JobSpec
from workers.delivery import jobstate
from workers.redisdb.keys import JOBS_KEY, JobKeys

# Every state a job is shown in: the three an operator sets, and the derived one.
STATES = ("running", "paused", "cancelled", "done")
# Sink run states (workers/wiring/sink_task.py) that mean a new version is being written.
BUILDING = frozenset({"queued", "running", "retrying"})


def job_state(stored: str, done: bool) -> str:
    """The state shown for a job: ``cancelled`` stays, a finished job is ``done``."""
    if stored == "cancelled":
        return stored
    return "done" if done else stored


def version_number(version: str | None) -> int | None:
    """The sequence number of a data-set version name (``v000003-1a2b3c4d`` -> 3)."""
    if not version or not version.startswith("v"):
        return None
    try:
        return int(version[1:].split("-")[0])
    except ValueError:
        return None


def dataset_state(sink: dict[bytes, bytes]) -> tuple[str | None, str | None]:
    """(what the data set is, its committed version) from the sink's Redis hash:
    ``building``, ``committed vN`` (``, incomplete`` when rows are missing), ``sink failed``,
    or None when no sink has run."""
    state = sink.get(b"state", b"").decode()
    if state in BUILDING:
        return "building", None
    if state == "failed":
        return "sink failed", None
    if state == "done" and b"summary" in sink:
        summary = orjson.loads(sink[b"summary"])
        version = summary.get("version")
        text = f"committed v{version_number(version)}"
        return (text if summary.get("complete") else f"{text}, incomplete"), version
    return None, None


def quality_failed(sink: dict[bytes, bytes]) -> list[str] | None:
    """The quality gates the committed data set failed (workers/dataset/quality_gates.py;
    None when no sink has committed one)."""
    if sink.get(b"state", b"").decode() != "done" or b"summary" not in sink:
        return None
    return list(orjson.loads(sink[b"summary"]).get("quality_failed") or [])


def shown_state(state: str, failed: list[str] | None, warning: list[str] | None = None) -> str:
    """The state with the data set's quality: ``done, quality: 2 gates failed: near_empty,
    truncated``, or while it runs the live warning: ``running, quality warning: near_empty``."""
    if failed is None and warning:
        return f"{state}, quality warning: {', '.join(warning)}"
    if not failed:
        return state
    from workers.dataset.quality_gates import summary

    return f"{state}, {summary([{'gate': g} for g in failed])}: {', '.join(failed)}"


def read(r: redis.Redis, spec: JobSpec, now: float | None = None) -> dict[str, Any]:
    """The job's progress from Redis: counters, batches, state, time span and data set."""
    now = time.time() if now is None else now
    keys = JobKeys(spec.name)
    pipe = r.pipeline()
    pipe.hmget(keys.job, ["state", "started_at", "first_taken_at", "last_row_at",
                          *jobstate.SPLIT_FIELDS, "paused_by"])
    pipe.scard(keys.done)
    pipe.hgetall(keys.sink)
    (state_raw, *times, parts, split_rows, paused_by), done_batches, sink = pipe.execute()
    started_at, first_taken_at, last_row_at = (float(t) if t else None for t in times)
    c = jobstate.counters(r, spec.name)
    finished = c["completed"] + c["failed"] + c["quarantined"]
    # The counters count (prompt, sample) rows: with N samples, every sample must be in.
    done = done_batches >= spec.n_batches and finished >= spec.expected_samples
    started = started_at or now
    end = last_row_at if done and last_row_at else now
    active_from = first_taken_at or started
    dataset, version = dataset_state(sink)
    return {"quality_failed": quality_failed(sink),
        "state": job_state((state_raw or b"running").decode(), done), "done": done,
        # Why a worker paused the job (--on-quality-warning pause), while it stays paused.
        "paused_by": paused_by.decode() if paused_by and state_raw == b"paused" else None,
        "counters": c, "finished": finished, "done_batches": done_batches,
        "started_at": started, "first_taken_at": first_taken_at, "last_row_at": last_row_at,
        "elapsed_s": round(max(end - started, 0.0), 1),
        "active_s": round(max(end - active_from, 0.0), 1) if first_taken_at else 0.0,
        "dataset": dataset, "dataset_version": version,
        "splits": {"parts": int(parts or 0), "rows": int(split_rows or 0)},
    }


def list_jobs(r: redis.Redis, early_rows: int | None = None) -> list[dict[str, Any]]:
    """Every job Redis knows, with its state, progress, data set, the quality gates its
    committed data set failed and those its live tally breaks (``quality_warning``, once
    ``early_rows`` rows are in: FLEET_QUALITY_EARLY_ROWS unless given)."""
    from config.settings import load_settings
    from workers.delivery.quality_live import read_live

    if early_rows is None:
        early_rows = load_settings().quality_early_rows

    out = []
    for name in sorted(n.decode() for n in r.smembers(JOBS_KEY)):
        raw = r.hget(JobKeys(name).job, "spec")
        if not raw:
            continue
        spec = JobSpec.model_validate_json(raw)
        p = read(r, spec)
        c = p["counters"]
        total = spec.expected_samples  # the counters count samples
        out.append({"job": name, "state": p["state"],
                    "quality_failed": p["quality_failed"],
                    "quality_warning": [g["gate"] for g in
                                        read_live(r, spec, early_rows)["failed"]],
                    "total": total,
                    "completed": c["completed"], "failed": c["failed"],
                    "quarantined": c["quarantined"], "done_batches": p["done_batches"],
                    "n_batches": spec.n_batches, "done": p["done"],
                    "progress": round(p["finished"] / total, 4) if total else 0,
                    "elapsed_s": p["elapsed_s"], "dataset": p["dataset"],
                    "dataset_version_number": version_number(p["dataset_version"])})
    return out


def brief(r: redis.Redis) -> dict[str, str]:
    """Each job's state and data set in a few words (Flower's worker page)."""
    return {j["job"]: f"{j['state']} {100 * j['progress']:.1f} %"
            + (f", data set {j['dataset']}" if j["dataset"] else "") for j in list_jobs(r)}
