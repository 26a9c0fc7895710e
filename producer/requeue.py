"""Send quarantined (or truncated) prompts of a finished job back to the GPUs.

For each batch holding such rows: the rows to keep are put back into the batch's progress hash
(so workers do not regenerate them), the counters forget the rows being redone, the crash
counts of those prompts are cleared, an optional new ``max_new_tokens`` is written into their
staged input, the batch's result object is removed, and the batch is enqueued again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import redis
from celery import Celery

from workers import jobstate
from workers.celery_app import SHARED_QUEUE
from workers.jobs import (
    JobSpec,
    batch_of_result_key,
    decode_rows,
    encode_rows,
    input_key,
    result_key,
    results_prefix,
)
from workers.store import Store


@dataclass
class RequeueReport:
    """What requeue-failed did."""

    batches: int = 0
    rows: int = 0


def _selected(row: dict[str, Any], truncated: bool) -> bool:
    if truncated:
        return row.get("status") == "ok" and row.get("finish_reason") == "length"
    return row.get("status") == "failed"


def _restage(store: Store, job: str, batch: int, indices: set[int],
             max_new_tokens: int | None) -> None:
    if max_new_tokens is None:
        return
    rows = decode_rows(store.get(input_key(job, batch)))
    for row in rows:
        if row["index"] in indices:
            params = row.get("params") or {}
            params.pop("max_tokens", None)
            row["params"] = {**params, "max_new_tokens": max_new_tokens}
    store.put(input_key(job, batch), encode_rows(rows, compress=True))


def _reopen(r: redis.Redis, job: str, batch: int, keep: list[dict[str, Any]],
            redo: list[dict[str, Any]]) -> None:
    keys = jobstate.Keys(job)
    pipe = r.pipeline()
    pipe.delete(keys.progress(batch))
    if keep:
        pipe.hset(keys.progress(batch), mapping={str(x["index"]): orjson.dumps(x) for x in keep})
    # The batch now adds only the rows it keeps; the redone ones count again when recorded.
    jobstate.set_batch_counts(pipe, job, batch, jobstate.batch_counts(keep))
    pipe.hdel(f"{keys.job}:crashes", *[str(x["index"]) for x in redo])
    pipe.srem(keys.done, batch)
    pipe.execute()


def requeue_failed(store: Store, r: redis.Redis, app: Celery, spec: JobSpec, truncated: bool,
                   max_new_tokens: int | None) -> RequeueReport:
    """Reopen every batch with failed (or truncated) rows; see the module docstring."""
    report = RequeueReport()
    for key in store.list(results_prefix(spec.name)):
        batch = batch_of_result_key(key)
        if batch is None:
            continue
        rows = decode_rows(store.get(key))
        redo = [x for x in rows if _selected(x, truncated)]
        if not redo:
            continue
        keep = [x for x in rows if not _selected(x, truncated)]
        _restage(store, spec.name, batch, {x["index"] for x in redo}, max_new_tokens)
        _reopen(r, spec.name, batch, keep, redo)
        store.delete(result_key(spec.name, batch))
        app.send_task("fleet.run_batch", args=[spec.name, batch], queue=SHARED_QUEUE)
        report.batches += 1
        report.rows += len(redo)
    return report
