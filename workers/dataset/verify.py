"""Check a job's rows from the result store alone (never from Redis counters).

One :class:`RowCheck` is used both by ``verify`` (reading every stored result) and by the sink
(over the rows it writes into the data set), so the two always say the same thing: a row is
counted once, in one bucket (``ok``, ``truncated``, ``failed`` or ``quarantined``, as
:func:`workers.dataset.manifest.row_bucket` decides); a second row for an index is a duplicate,
reported
and kept out of the counts; a row outside its batch's index range, or whose ``id`` is not the
staged input's id at that index, is misplaced, reported and kept out too.

A prompt with N samples stands for N rows, ``sample`` 0 … N-1 (N: the staged row's own ``n``,
else the job's): each (index, sample) is counted once, ``expected`` counts every sample, and
the report adds ``prompts`` (every prompt of the job) and ``samples`` (the distinct (prompt,
sample) rows found). A sample number outside 0 … N-1 is misplaced.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from workers.dataset.jobs import (
    JobSpec,
    batch_of_result_key,
    decode_rows,
    input_key,
    result_key,
    results_prefix,
)
from workers.dataset.manifest import Tally
from workers.dataset.quality import QualityTally
from workers.dataset.quality_gates import evaluate, thresholds
from workers.dataset.quality_options import job_options
from workers.dataset.samples import row_samples, row_unit
from workers.dataset.store import ObjectMissing, Store

PREFETCH = 8
T = TypeVar("T")
U = TypeVar("U")
StagedIds = dict[int, str] | None
# index -> samples of each staged row (None: the staged input is gone).
StagedSamples = dict[int, int] | None


@dataclass
class RowCheck:
    """Counts over a job's result rows; :meth:`accept` says which rows belong in the data set."""

    spec: JobSpec
    tally: Tally = field(default_factory=Tally)
    rows: int = 0
    duplicates: int = 0
    misplaced: int = 0
    out_of_range: int = 0
    _seen: set[tuple[int, int]] = field(default_factory=set)
    examples: list[str] = field(default_factory=list)
    # The samples of each index of the batch being checked (None: the job's for every row).
    samples: StagedSamples = None
    # Quality thresholds overriding the job's (verify --quality); the measurement itself.
    quality_override: dict[str, float] | None = None
    # The sink measures quality over the tables it writes (quality.add_table), not here.
    defer_quality: bool = False
    quality: QualityTally = field(init=False)

    def __post_init__(self) -> None:
        limits = thresholds(self.spec.quality, self.quality_override)
        self.quality = QualityTally(job_options(self.spec, int(limits["near_empty_tokens"])))

    def _problem(self, what: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(what)

    def accept(self, batch: int, row: dict[str, Any], staged_ids: StagedIds) -> bool:
        """Count ``row`` (stored in ``batch``); True when it belongs in the data set.

        ``staged_ids`` maps the batch's indices to their input ids (None: the staged input is
        gone, so only the index range is checked)."""
        self.rows += 1
        idx, sample = row_unit(row)
        if not 0 <= idx < self.spec.total:
            self.out_of_range += 1
            self._problem(f"batch {batch}: index {idx} is outside the job (0..{self.spec.total})")
            return False
        own_id = staged_ids is None or str(row.get("id")) == staged_ids.get(idx)
        if idx not in self.spec.batch_range(batch) or not own_id:
            self.misplaced += 1
            self._problem(f"batch {batch}: row index {idx} id {row.get('id')!r} is not the "
                          f"staged row of this batch")
            return False
        n = (self.samples or {}).get(idx, self.spec.sampling.samples)
        if not 0 <= sample < max(n, 1):
            self.misplaced += 1
            self._problem(f"batch {batch}: row index {idx} sample {sample} is not one of its "
                          f"{n} samples")
            return False
        if (idx, sample) in self._seen:
            self.duplicates += 1
            self._problem(f"batch {batch}: index {idx} sample {sample} appears twice"
                          if sample else f"batch {batch}: index {idx} appears twice")
            return False
        self._seen.add((idx, sample))
        self.tally.add(row)
        if not self.defer_quality:
            self.quality.add(row)
        return True

    def report(self) -> dict[str, Any]:
        """The verify report: ``counts`` (the manifest's buckets; ``failed``, ``quarantined``
        and ``truncated`` also at the top), problems, and ``ok`` (every prompt exactly once)."""
        unique = len(self._seen)
        missing = self.spec.expected_samples - unique
        counts = self.tally.counts
        return {
            "job": self.spec.name, "expected": self.spec.expected_samples, "rows": self.rows,
            "prompts": self.spec.total, "samples": unique,
            "unique": unique, "duplicates": self.duplicates, "missing": missing,
            "failed": counts["failed"], "quarantined": counts["quarantined"],
            "truncated": counts["truncated"], "counts": dict(counts),
            "misplaced": self.misplaced, "out_of_range": self.out_of_range,
            "problems": list(self.examples),
            "ok": (missing == 0 and self.duplicates == 0 and self.misplaced == 0
                   and self.out_of_range == 0),
            "quality": self.quality_report(),
        }

    def quality_report(self) -> dict[str, Any]:
        """The quality figures, the thresholds in force and the gates that fail."""
        limits = thresholds(self.spec.quality, self.quality_override)
        measured = self.quality.report()
        failed = evaluate(measured, limits)
        return {**measured, "thresholds": limits, "failed": failed,
                "gates_failed": [g["gate"] for g in failed], "ok": not failed}


def prefetched(fn: Callable[[T], U], items: Iterable[T], window: int = PREFETCH) -> Iterator[U]:
    """``map(fn, items)`` in order, with up to ``window`` calls running ahead in threads."""
    with ThreadPoolExecutor(max_workers=window) as pool:
        pending: deque[Future[U]] = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def staged_rows(store: Store, job: str, batch: int) -> list[dict[str, Any]] | None:
    """A batch's staged prompts as dicts (None when the staged object is gone)."""
    try:
        return decode_rows(store.get(input_key(job, batch)))
    except ObjectMissing:
        return None


def staged_samples(rows: list[dict[str, Any]] | None, job_samples: int) -> StagedSamples:
    """index -> samples of each staged row (its own ``n``, else the job's)."""
    if rows is None:
        return None
    return {int(r["index"]): row_samples(r.get("params"), job_samples) for r in rows}


class StoredBatch(NamedTuple):
    """One stored batch as verify and the sink read it."""

    batch: int
    raw: bytes  # the result object's bytes
    rows: list[dict[str, Any]]  # sorted by (index, sample)
    ids: StagedIds  # index -> id of the staged prompts (None: the staged input is gone)
    samples: StagedSamples  # index -> samples (None: a one-sample job, or no staged input)
    staged: list[dict[str, Any]] | None  # the staged prompts (None: the staged input is gone)


def batch_rows(store: Store, job: str, batch: int, job_samples: int | None = None
               ) -> StoredBatch:
    """One stored batch with its staged prompts' ids, and their samples when ``job_samples``
    is given (the job's N: a job of several samples). The staged input is read once."""
    raw = store.get(result_key(job, batch))
    rows = sorted(decode_rows(raw), key=row_unit)
    staged = staged_rows(store, job, batch)
    ids = None if staged is None else {int(r["index"]): str(r["id"]) for r in staged}
    samples = None if job_samples is None else staged_samples(staged, job_samples)
    return StoredBatch(batch, raw, rows, ids, samples, staged)


def stored_batches(store: Store, job: str) -> list[int]:
    """Batches whose result object is in the store, in order."""
    return sorted(b for k in store.list(results_prefix(job))
                  if (b := batch_of_result_key(k)) is not None)


def iter_batches(store: Store, spec: JobSpec) -> Iterator[StoredBatch]:
    """Every stored batch of ``spec`` in order, read a few ahead (see :func:`batch_rows`)."""
    several = spec.sampling.samples if spec.expected_samples != spec.total else None
    yield from prefetched(lambda b: batch_rows(store, spec.name, b, several),
                          stored_batches(store, spec.name))


def verify_job(store: Store, spec: JobSpec,
               quality: dict[str, float] | None = None) -> dict[str, Any]:
    """Check every stored batch result against the job; see the module docstring.
    ``quality`` overrides the job's quality thresholds (verify --quality)."""
    check = RowCheck(spec, quality_override=quality)
    for stored in iter_batches(store, spec):
        check.samples = stored.samples
        check.quality.options.clear_rows()
        check.quality.options.add_rows(stored.staged)
        for row in stored.rows:
            check.accept(stored.batch, row, stored.ids)
    return check.report()
