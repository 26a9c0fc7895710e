"""Send the rows of a job that a quality figure names back to the GPUs (``fleet requeue
--where near_empty,truncated,failed``; ``requeue-failed`` is ``--where failed,quarantined``).

A row is selected when :func:`workers.dataset.quality.judge` puts it under one of the named
per-row figures (``quality_gates.PER_ROW``: near_empty, invalid, no_reasoning, markers,
truncated, failed, quarantined), by the same rule, thresholds and row kinds the sink and
``verify`` use. Each selected (prompt, sample) is generated once more and replaces its row;
every other row is kept byte for byte, and the sink writes the data set's next version when
the last requeued batch is stored.

The whole command holds the job's data-set lock (:mod:`workers.dataset.sink_lock`), so it never runs
beside the sink. Before it deletes anything it removes ``_SUCCESS`` and marks the committed
manifest incomplete (``complete: false``, ``reopened``), and it re-arms the sink's automatic
trigger, so the last requeued batch aggregates the job again.

For each batch holding such rows: the rows to keep are put back into the batch's progress hash
(so workers do not regenerate them), the counters forget the rows being redone, the crash
counts of those prompts are cleared, an optional new ``max_new_tokens`` is written into their
staged input, the batch's result object is removed, and the batch is enqueued again. The
job's live quality tally starts over (it then tells of the regenerated rows). A paused or
cancelled job is refused: its requeued batches would not run.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery

from workers.dataset.jobs import (
    JobSpec,
    batch_of_result_key,
    compress_rows,
    decode_rows,
    encode_rows,
    input_key,
    result_key,
    results_prefix,
    save_spec,
    staged_sha256,
)
from workers.dataset.manifest import encode_manifest, load_manifest, manifest_key, success_key
from workers.dataset.quality import judge
from workers.dataset.quality_gates import PER_ROW, thresholds
from workers.dataset.quality_options import QualityOptions, job_options
from workers.dataset.samples import row_key
from workers.dataset.sink_lock import SinkLock
from workers.dataset.store import Store
from workers.dataset.verify import staged_rows
from workers.delivery import jobstate
from workers.delivery.progress import spill_rows
from workers.delivery.sink_requests import reset_auto_trigger
from workers.errors import InputError, JobError
from workers.node.queues import BATCH_TASK, SHARED_QUEUE
from workers.redisdb.keys import JobKeys

LOCK_WAIT_S = 300.0
# What requeue-failed redoes (--truncated: "truncated").
FAILED = frozenset({"failed", "quarantined"})
# Figures that depend on whether a row asked for structured output (its staged params).
BY_FORM = frozenset({"near_empty", "invalid"})


@dataclass
class RequeueReport:
    """What a requeue did: batches reopened, rows sent again, and those rows by figure."""

    batches: int = 0
    rows: int = 0
    by: dict[str, int] = field(default_factory=dict)


def parse_where(text: str) -> frozenset[str]:
    """``--where near_empty,truncated,failed``: per-row figure names; InputError for others."""
    names = frozenset(x.strip() for x in text.split(",") if x.strip())
    unknown = sorted(names - set(PER_ROW))
    if unknown or not names:
        raise InputError("--where", None, f"{', '.join(unknown) or 'nothing'}: name per-row "
                                          f"figures, comma-separated ({', '.join(PER_ROW)})")
    return names


def _selected(row: dict[str, Any], where: frozenset[str], options: QualityOptions
              ) -> tuple[str, ...]:
    """The figures of ``where`` that ``row`` falls under (empty: keep the row)."""
    return tuple(f for f in judge(row, options).flags if f in where)


def _restage(store: Store, job: str, batch: int, indices: set[int],
             max_new_tokens: int | None) -> str | None:
    """Write the new token cap into the staged rows; return the batch's new sha256."""
    if max_new_tokens is None:
        return None
    rows = decode_rows(store.get(input_key(job, batch)))
    for row in rows:
        if row["index"] in indices:
            params = row.get("params") or {}
            params.pop("max_tokens", None)
            row["params"] = {**params, "max_new_tokens": max_new_tokens}
    data = encode_rows(rows, compress=False)
    store.put(input_key(job, batch), compress_rows(data))
    return staged_sha256(data)


def mark_reopened(store: Store, job: str) -> None:
    """``_SUCCESS`` goes, then the committed manifest says incomplete: from here on no reader
    takes the data set for complete while its results change."""
    store.delete(success_key(job))
    manifest = load_manifest(store, job)
    if manifest is not None and (manifest.get("complete") or not manifest.get("reopened")):
        manifest.update(complete=False, reopened=True)
        store.put(manifest_key(job), encode_manifest(manifest))


def _reopen(store: Store, r: redis.Redis, job: str, batch: int, keep: list[dict[str, Any]],
            redo: list[dict[str, Any]]) -> None:
    keys = JobKeys(job)
    chunk = spill_rows(store, job, batch, f"requeue-{uuid.uuid4().hex[:12]}", keep) if keep \
        else ""
    pipe = r.pipeline()
    pipe.delete(keys.progress(batch))
    if keep:  # the kept rows wait in the store; Redis records where, as the workers do
        # Per (prompt, sample): the other samples of a prompt with a failed one are kept.
        pipe.hset(keys.progress(batch),
                  mapping={row_key(x): chunk for x in keep})
    # The batch now adds only the rows it keeps; the redone ones count again when recorded.
    jobstate.set_batch_counts(pipe, job, batch, jobstate.batch_counts(keep))
    pipe.hdel(keys.crashes, *{str(x["index"]) for x in redo})
    pipe.srem(keys.done, batch)
    pipe.execute()


def requeue_failed(store: Store, r: redis.Redis, app: Celery, spec: JobSpec, truncated: bool,
                   max_new_tokens: int | None) -> RequeueReport:
    """``requeue-failed``: :func:`requeue` of the failed and quarantined rows (or, with
    ``truncated``, of the truncated ones)."""
    where = frozenset({"truncated"}) if truncated else FAILED
    return requeue(store, r, app, spec, where, max_new_tokens)


def requeue(store: Store, r: redis.Redis, app: Celery, spec: JobSpec, where: frozenset[str],
            max_new_tokens: int | None) -> RequeueReport:
    """Reopen every batch with rows under a figure of ``where``; see the module docstring."""
    state = r.hget(JobKeys(spec.name).job, "state")
    if state in (b"paused", b"cancelled"):
        raise JobError(f"job {spec.name} is {state.decode()}: its requeued batches would not "
                       f"run (fleet resume --job {spec.name} first)")
    with SinkLock(r, spec.name, f"requeue-{uuid.uuid4().hex}") as lock:
        lock.acquire(LOCK_WAIT_S)
        return _requeue(store, r, app, spec, where, max_new_tokens, lock)


def _pick(store: Store, spec: JobSpec, batch: int, rows: list[dict[str, Any]],
          where: frozenset[str], options: QualityOptions, report: RequeueReport
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows to redo, rows to keep) of one stored batch; the redone ones counted by figure."""
    options.clear_rows()
    if where & BY_FORM:  # whether a row is judged by its text or its form: its own params
        options.add_rows(staged_rows(store, spec.name, batch))
    redo, keep = [], []
    for row in rows:
        why = _selected(row, where, options)
        (redo if why else keep).append(row)
        for name in why:
            report.by[name] = report.by.get(name, 0) + 1
    return redo, keep


def _requeue(store: Store, r: redis.Redis, app: Celery, spec: JobSpec, where: frozenset[str],
             max_new_tokens: int | None, lock: SinkLock) -> RequeueReport:
    report = RequeueReport()
    reopened: list[int] = []
    shas = list(spec.input_sha256)
    options = job_options(spec, int(thresholds(spec.quality)["near_empty_tokens"]))
    for key in store.list(results_prefix(spec.name)):
        batch = batch_of_result_key(key)
        if batch is None:
            continue
        redo, keep = _pick(store, spec, batch, decode_rows(store.get(key)), where, options,
                           report)
        if not redo:
            continue
        if not reopened:
            lock.check()
            mark_reopened(store, spec.name)
        sha = _restage(store, spec.name, batch, {x["index"] for x in redo}, max_new_tokens)
        if sha is not None and batch < len(shas):
            shas[batch] = sha
        _reopen(store, r, spec.name, batch, keep, redo)
        store.delete(result_key(spec.name, batch))
        reopened.append(batch)
        report.rows += len(redo)
    # Every batch is reopened before any is sent, and the trigger is re-armed, so only the
    # last of them to finish starts the sink again.
    if shas != spec.input_sha256:  # workers check the staged batches against the record
        save_spec(store, spec.model_copy(update={"input_sha256": shas}))
    reset_auto_trigger(r, spec.name)
    if reopened:  # the live tally starts over: it tells of the regenerated rows
        quality = JobKeys(spec.name).quality
        r.delete(quality, *(f"{quality}:ex:{name}" for name in PER_ROW))
    for batch in reopened:
        app.send_task(BATCH_TASK, args=[spec.name, batch], queue=SHARED_QUEUE)
    report.batches = len(reopened)
    return report
