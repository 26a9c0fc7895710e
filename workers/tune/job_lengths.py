"""The running job's lengths, for the snapshot's ``job`` section (read by workers/tune/kv_floor.py).

The tuner sizes a launch's KV pool for the job a GPU is running, not for what its requests held
at one moment. A worker's batches name their job in the node's in-flight hash
(``job/batch`` fields, workers/delivery/gpu_share.py); the job record (Redis' copy of the
store's ``job.json``, else the store) gives ``max_new_tokens``; the rows of its finished batches
in the store give the prompt and output lengths and their spread, and the live counters
(completed rows, output tokens) the mean output when no batch has finished yet. Each step is
best effort: what cannot be read is left out and the section says where its figures came from.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any

import redis

from config.settings import Settings
from workers.dataset.jobs import (
    JobSpec,
    decode_rows,
    input_key,
    load_spec,
    results_prefix,
)
from workers.dataset.store import Store, open_store
from workers.delivery import jobstate
from workers.errors import FleetError
from workers.redisdb.keys import JOBS_KEY, JobKeys, NodeKeys

log = logging.getLogger(__name__)

# Stored result files read for the lengths (the newest), and staged rows read for max_tokens.
RESULT_FILES = 2
OUTPUT_KEYS = ("max_completion_tokens", "max_tokens", "max_new_tokens")


def running_job(r: redis.Redis, node: str | None) -> str | None:
    """The job ``node``'s batches are running (most in-flight batches), else the latest job
    marked running."""
    if node is not None:
        tags = r.hkeys(NodeKeys(node).in_flight)
        jobs = Counter(t.decode().rpartition("/")[0] for t in tags)
        jobs.pop("", None)
        if jobs:
            return jobs.most_common(1)[0][0]
    latest: tuple[float, str] | None = None
    for raw in r.smembers(JOBS_KEY):
        name = raw.decode()
        state, started = r.hmget(JobKeys(name).job, "state", "started_at")
        if state == b"running" and (latest is None or float(started or 0) > latest[0]):
            latest = (float(started or 0), name)
    return latest[1] if latest else None


def _spec(r: redis.Redis, job: str, store: Store | None) -> JobSpec | None:
    raw = r.hget(JobKeys(job).job, "spec")
    if raw:
        return JobSpec.model_validate_json(raw)
    return load_spec(store, job) if store is not None else None


def _row_max_new(store: Store, job: str) -> int | None:
    """The largest per-row output budget of the job's first staged batch (OpenAI-batch rows
    carry their own ``max_tokens``)."""
    rows = decode_rows(store.get(input_key(job, 0)))
    found = [int(v) for row in rows for k in OUTPUT_KEYS
             if (v := (row.get("params") or {}).get(k)) is not None]
    return max(found) if found else None


def _stored_lengths(store: Store, job: str) -> dict[str, Any]:
    """Mean prompt and output tokens and the output's second moment over the newest stored
    result files' answered rows."""
    keys = sorted(store.list(results_prefix(job)))[-RESULT_FILES:]
    prompts, outputs = [], []
    for key in keys:
        for row in decode_rows(store.get(key)):
            if row.get("status") == "ok" and row.get("completion_tokens"):
                prompts.append(int(row.get("prompt_tokens") or 0))
                outputs.append(int(row["completion_tokens"]))
    if not outputs:
        return {}
    n = len(outputs)
    return {"rows": n, "prompt_tokens_mean": sum(prompts) / n,
            "output_tokens_mean": sum(outputs) / n,
            "output_tokens_sq_mean": sum(o * o for o in outputs) / n,
            "output_source": f"stored results ({len(keys)} batch files)"}


def job_section(r: redis.Redis, node: str | None,
                store: Store | None = None) -> dict[str, Any] | None:
    """The snapshot's ``job`` section for ``node``'s running job, or None when none is found."""
    try:
        job = running_job(r, node)
        if job is None:
            return None
        spec = _spec(r, job, store)
        counts = jobstate.counters(r, job)
    except (redis.RedisError, ValueError, OSError, FleetError) as exc:
        log.warning("tune: the running job's record could not be read: %s", exc)
        return None
    out: dict[str, Any] = {"name": job}
    if spec is not None:
        out["max_new_tokens"] = spec.sampling.max_new_tokens
        out["batch_size"] = spec.batch_size
        if spec.expected_samples != spec.total:
            # Each sample is a running request of its own (workers/batch/runner.py).
            out["samples_per_prompt"] = round(spec.expected_samples / max(spec.total, 1), 4)
    if counts["completed"] and counts["output_tokens"]:
        out.update(completed=counts["completed"],
                   output_tokens_mean=counts["output_tokens"] / counts["completed"],
                   output_source="job counters (completed rows)")
    if store is not None:
        try:
            if not out.get("max_new_tokens"):
                out["max_new_tokens"] = _row_max_new(store, job)
            out.update(_stored_lengths(store, job))
        except (OSError, ValueError, FleetError) as exc:
            out["store_error"] = str(exc)
    return out


def running_job_section(settings: Settings, r: redis.Redis,
                        node: str | None) -> dict[str, Any] | None:
    """:func:`job_section` with the fleet's store (None when Redis cannot be read)."""
    try:
        store: Store | None = open_store(settings.store_url, settings.s3)
    except (FleetError, OSError, ValueError):
        store = None
    try:
        section = job_section(r, node, store)
    except redis.RedisError:
        return None
    if section is not None and section.get("batch_size"):
        # What a worker can have in flight at most: its batches' prompts
        # (workers/wiring/celery_app.py), each sample of a prompt a running request of its own.
        samples = float(section.get("samples_per_prompt") or 1.0)
        section["worker_prompts_max"] = math.ceil(
            settings.batches_per_gpu * int(section["batch_size"]) * samples)
    return section
