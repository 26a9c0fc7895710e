"""Result reuse: ``enqueue --reuse-from OLD`` copies finished rows instead of regenerating them.

A row of the new job reuses a row of OLD when both have the same content key, the sha256 of
the prompt or messages and the row's effective sampling (job sampling with the row's own
overrides: exactly what a worker would send), and OLD's row finished ``ok`` on an engine
launched exactly as this producer's profile (``FLEET_PROFILE``) says: every row records the
digest of its engine's effective launch flags and environment
(:func:`workers.dataset.manifest.launch_digest`), and only rows with the digest of that profile, as
it is now on disk, are reused (an edited profile under the same name, a worker running
another profile, or a row from before digests were recorded is regenerated). Failed rows are
never reused. Repeated prompts are
matched one to one, in order, over the whole job, so the same old completion is never copied
twice and a re-run of ``enqueue`` assigns the same rows. Samples are matched one by one too:
each (prompt, sample) has its own key, since its effective sampling includes the seed derived
for that sample (workers/dataset/samples.py).

A batch whose every row is covered is written straight to the store as a result (rows
re-keyed to the new job, ``reused_from`` set) and is never enqueued; a batch only partly
covered gets the reused rows in its Redis progress hash (through RECORD_ROWS, so the counters
move exactly once) and its worker sends only the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from config.launch_profile import ProfileError, load_profile
from workers.batch.prompt_sampling import sampling_for
from workers.dataset.jobs import (
    JobSpec,
    PromptRow,
    decode_rows,
    encode_rows,
    load_batch_input,
    load_spec,
    result_key,
)
from workers.dataset.manifest import launch_digest, row_bucket
from workers.dataset.samples import prompt_units, row_key, row_unit
from workers.dataset.sink import prefetched, stored_batches
from workers.dataset.store import Store
from workers.delivery import jobstate, whereabouts
from workers.delivery.progress import spill_rows
from workers.errors import JobError
from workers.redisdb import scripts
from workers.redisdb.keys import JOBS_KEY, JobKeys

REUSE_NODE = "reuse"
CACHED_BATCHES = 16


@dataclass
class ReuseReport:
    """What reuse did for one ``enqueue`` run."""

    source: str
    rows: int = 0
    batches: int = 0
    partial_batches: int = 0
    candidates: int = 0

    def summary(self) -> str:
        """One line for the enqueue output."""
        from producer.render import plural

        return (f"reused {plural(self.rows, 'row')} from job {self.source} "
                f"({plural(self.candidates, 'finished row')} there): "
                f"{plural(self.batches, 'batch')} stored without a GPU, "
                f"{self.partial_batches} partly pre-filled")


def content_key(spec: JobSpec, row: PromptRow, sample: int = 0) -> bytes:
    """Identity of a request: prompt or messages plus its effective sampling parameters
    (for a sample of several, its own derived seed among them)."""
    doc = {"prompt": row.prompt, "messages": row.messages,
           "sampling": dataclasses.asdict(sampling_for(spec, row, sample))}
    return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).digest()[:20]


class SourceRows:
    """The reusable rows of the source job, found by content key."""

    def __init__(self, store: Store, spec: JobSpec, digest: str) -> None:
        self.store, self.spec, self.digest = store, spec, digest
        self._where: dict[bytes, deque[tuple[int, tuple[int, int]]]] = defaultdict(deque)
        self._cache: OrderedDict[int, dict[tuple[int, int], dict[str, Any]]] = OrderedDict()
        for batch, inputs, results in prefetched(self._load, stored_batches(store, spec.name)):
            ok = {row_unit(r) for r in results
                  if r.get("status") == "ok" and r.get("launch_digest") == digest}
            for row, sample in prompt_units(inputs, spec.sampling.samples):
                if (row.index, sample) in ok:
                    self._where[content_key(spec, row, sample)].append(
                        (batch, (row.index, sample)))

    def __len__(self) -> int:
        return sum(len(v) for v in self._where.values())

    def _load(self, batch: int) -> tuple[int, list[PromptRow], list[dict[str, Any]]]:
        results = decode_rows(self.store.get(result_key(self.spec.name, batch)))
        return batch, load_batch_input(self.store, self.spec.name, batch), results

    def _results(self, batch: int) -> dict[tuple[int, int], dict[str, Any]]:
        if batch not in self._cache:
            raw = self.store.get(result_key(self.spec.name, batch))
            self._cache[batch] = {row_unit(x): x for x in decode_rows(raw)}
            while len(self._cache) > CACHED_BATCHES:
                self._cache.popitem(last=False)
        self._cache.move_to_end(batch)
        return self._cache[batch]

    def take(self, key: bytes) -> tuple[int, tuple[int, int]] | None:
        """Claim the next unused source row with this key: (batch, (index, sample)), or
        None."""
        found = self._where.get(key)
        return found.popleft() if found else None

    def row(self, where: tuple[int, tuple[int, int]]) -> dict[str, Any]:
        """The stored result row at (batch, (index, sample))."""
        return self._results(where[0])[where[1]]


def _rekey(old: dict[str, Any], spec: JobSpec, batch: int, row: PromptRow, sample: int,
           source: str) -> dict[str, Any]:
    out = {**old, "job": spec.name, "batch": batch, "index": row.index, "sample": sample,
           "id": row.id, "prompt": row.prompt, "messages": row.messages,
           "reused_from": source}
    out.pop("keep", None)
    if row.keep is not None:
        out["keep"] = row.keep  # the new job's kept columns, not the old one's
    return out


def _quarantined(spec: JobSpec, batch: int, row: PromptRow, sample: int, profile: str
                 ) -> dict[str, Any]:
    """The failed row a worker would write for a row quarantined at read time."""
    out = {"job": spec.name, "batch": batch, "index": row.index, "sample": sample,
           "id": row.id, "prompt": row.prompt, "messages": row.messages, "completion": None,
           "reasoning": None, "finish_reason": None, "prompt_tokens": 0,
           "completion_tokens": 0, "latency_s": None, "status": "failed", "error": row.error,
           "profile": profile, "gpu": None, "node": REUSE_NODE, "launch_digest": None}
    if row.keep is not None:
        out["keep"] = row.keep
    return out


def _prefill(store: Store, r: redis.Redis, job: str, batch: int,
             rows: list[dict[str, Any]]) -> None:
    """Record reused rows as answered prompts of the batch (in a progress chunk, as the workers
    do), as its owner for a moment (skipped if a run owns the batch); counters move once,
    series not at all."""
    keys = JobKeys(job)
    token = f"{REUSE_NODE}|{uuid.uuid4().hex}"
    if not r.set(keys.owner(batch), token, nx=True, px=60_000):
        return
    chunk = spill_rows(store, job, batch, f"{REUSE_NODE}-{token[-12:]}", rows).encode()
    scratch = [keys.scratch(n) for n in range(3)]
    scripts.record_rows(r, job, batch, REUSE_NODE, token, [
        (row_key(x), chunk, row_bucket(x), x["completion_tokens"]) for x in rows], tally=scratch)
    r.delete(*scratch)
    scripts.release_if_owner(r, keys.owner(batch), token)


def _open_batches(store: Store, r: redis.Redis, spec: JobSpec) -> set[int]:
    """Batches of the new job that are not stored and have no message and no live run: the
    ones reuse may fill."""
    where = whereabouts.locate(store, r, spec.name)
    return {b for b in range(spec.n_batches)
            if b not in where.stored and not where.has_message_or_holder(b)}


def apply_reuse(store: Store, r: redis.Redis, spec: JobSpec, source: str,
                profile: str) -> ReuseReport:
    """Fill the new job's open batches from ``source``; see the module docstring."""
    if source == spec.name:
        raise JobError(f"--reuse-from must name another job than {spec.name!r}")
    try:
        digest = launch_digest(load_profile(profile))
    except ProfileError as exc:
        raise JobError(f"--reuse-from needs this producer's launch profile: {exc}") from exc
    src = SourceRows(store, load_spec(store, source), digest)
    report = ReuseReport(source=source, candidates=len(src))
    todo = _open_batches(store, r, spec)
    for batch in range(spec.n_batches):
        rows = load_batch_input(store, spec.name, batch)
        units = list(prompt_units(rows, spec.sampling.samples))
        hits = {(row.index, s): w for row, s in units
                if not row.error and (w := src.take(content_key(spec, row, s))) is not None}
        if batch not in todo or not hits:
            continue
        reused = [_rekey(src.row(hits[(row.index, s)]), spec, batch, row, s, source)
                  for row, s in units if (row.index, s) in hits]
        report.rows += len(reused)
        if all(row.error or (row.index, s) in hits for row, s in units):
            by_unit = {row_unit(x): x for x in reused}
            full = [by_unit.get((row.index, s)) or _quarantined(spec, batch, row, s, profile)
                    for row, s in units]
            store.put(result_key(spec.name, batch), encode_rows(full, compress=False))
            report.batches += 1
        else:
            _prefill(store, r, spec.name, batch, reused)
            report.partial_batches += 1
    return report


def reuse_hook(store: Store, r: redis.Redis, source: str | None, profile: str
               ) -> tuple[Callable[[JobSpec], None] | None, list[ReuseReport]]:
    """The ``before_reconcile`` hook of enqueue for ``--reuse-from`` and where it reports."""
    reports: list[ReuseReport] = []
    if not source:
        return None, reports

    def hook(spec: JobSpec) -> None:
        reports.append(apply_reuse(store, r, spec, source, profile))

    return hook, reports


def answered_twin(r: redis.Redis, spec: JobSpec) -> str | None:
    """One line when another job Redis knows was made from the same rows (the same input
    fingerprint) and has answered some: the job ``--reuse-from`` would copy them from."""
    for name in sorted(n.decode() for n in r.smembers(JOBS_KEY)):
        raw = r.hget(JobKeys(name).job, "spec") if name != spec.name else None
        if not raw or JobSpec.model_validate_json(raw).input_fingerprint \
                != spec.input_fingerprint:
            continue
        answered = jobstate.counters(r, name)["completed"]
        if answered:
            return (f"the rows of {spec.input_path} were already answered in job {name} "
                    f"({answered:,} completed): run this enqueue again with --reuse-from "
                    f"{name} to copy those with the same prompt, sampling and profile "
                    "instead of generating them again")
    return None

