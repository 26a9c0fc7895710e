"""Check a job's rows from the result store alone (never from Redis counters).

One :class:`RowCheck` is used both by ``verify`` (reading every stored result) and by the sink
(over the rows it writes into the data set), so the two always say the same thing: a row is
counted once, in one bucket (``ok``, ``truncated``, ``failed`` or ``quarantined``, as
:func:`workers.dataset.manifest.row_bucket` decides); a second row for an index is a duplicate,
reported
and kept out of the counts; a row outside its batch's index range, or whose ``id`` is not the
staged input's id at that index, is misplaced, reported and kept out too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from workers.dataset.jobs import (
    JobSpec,
    batch_of_result_key,
    decode_rows,
    input_key,
    result_key,
    results_prefix,
)
from workers.dataset.manifest import Tally
from workers.dataset.store import ObjectMissing, Store

PREFETCH = 8
T = TypeVar("T")
U = TypeVar("U")
StagedIds = dict[int, str] | None


@dataclass
class RowCheck:
    """Counts over a job's result rows; :meth:`accept` says which rows belong in the data set."""

    spec: JobSpec
    tally: Tally = field(default_factory=Tally)
    rows: int = 0
    duplicates: int = 0
    misplaced: int = 0
    out_of_range: int = 0
    _seen: set[int] = field(default_factory=set)
    examples: list[str] = field(default_factory=list)

    def _problem(self, what: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(what)

    def accept(self, batch: int, row: dict[str, Any], staged_ids: StagedIds) -> bool:
        """Count ``row`` (stored in ``batch``); True when it belongs in the data set.

        ``staged_ids`` maps the batch's indices to their input ids (None: the staged input is
        gone, so only the index range is checked)."""
        self.rows += 1
        idx = int(row["index"])
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
        if idx in self._seen:
            self.duplicates += 1
            self._problem(f"batch {batch}: index {idx} appears twice")
            return False
        self._seen.add(idx)
        self.tally.add(row)
        return True

    def report(self) -> dict[str, Any]:
        """The verify report: ``counts`` (the manifest's buckets; ``failed``, ``quarantined``
        and ``truncated`` also at the top), problems, and ``ok`` (every prompt exactly once)."""
        unique = len(self._seen)
        missing = self.spec.total - unique
        counts = self.tally.counts
        return {
            "job": self.spec.name, "expected": self.spec.total, "rows": self.rows,
            "unique": unique, "duplicates": self.duplicates, "missing": missing,
            "failed": counts["failed"], "quarantined": counts["quarantined"],
            "truncated": counts["truncated"], "counts": dict(counts),
            "misplaced": self.misplaced, "out_of_range": self.out_of_range,
            "problems": list(self.examples),
            "ok": (missing == 0 and self.duplicates == 0 and self.misplaced == 0
                   and self.out_of_range == 0),
        }


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


def staged_ids(store: Store, job: str, batch: int) -> StagedIds:
    """index -> id of a batch's staged prompts (None when the staged object is gone)."""
    try:
        raw = store.get(input_key(job, batch))
    except ObjectMissing:
        return None
    return {int(r["index"]): str(r["id"]) for r in decode_rows(raw)}


def batch_rows(store: Store, job: str, batch: int
               ) -> tuple[int, bytes, list[dict[str, Any]], StagedIds]:
    """(batch, raw result bytes, rows sorted by index, staged ids) of one stored batch."""
    raw = store.get(result_key(job, batch))
    rows = sorted(decode_rows(raw), key=lambda x: int(x["index"]))
    return batch, raw, rows, staged_ids(store, job, batch)


def stored_batches(store: Store, job: str) -> list[int]:
    """Batches whose result object is in the store, in order."""
    return sorted(b for k in store.list(results_prefix(job))
                  if (b := batch_of_result_key(k)) is not None)


def iter_batches(store: Store, spec: JobSpec
                 ) -> Iterator[tuple[int, bytes, list[dict[str, Any]], StagedIds]]:
    """Every stored batch of ``spec`` in order, read a few ahead (see :func:`batch_rows`)."""
    yield from prefetched(lambda b: batch_rows(store, spec.name, b),
                          stored_batches(store, spec.name))


def verify_job(store: Store, spec: JobSpec) -> dict[str, Any]:
    """Check every stored batch result against the job; see the module docstring."""
    check = RowCheck(spec)
    for batch, _, rows, ids in iter_batches(store, spec):
        for row in rows:
            check.accept(batch, row, ids)
    return check.report()
