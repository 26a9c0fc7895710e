"""What ``enqueue`` refuses once a new job's input is read, with nothing left staged.

Staging streams, so a few checks can only be made once every row went by: a ``--keep-columns``
name that no row had, and more rows quarantined at read time than the job's
``failed_or_quarantined`` gate allows (unless ``--allow-quarantine``). A refusal is an
:class:`InputError` (one line, exit 2); :func:`refused_unstaged` deletes the batches staged
for the refused job, and the folders a folder store made for them, and its record was never
written, so nothing of it is left. (A missing
prompt column is refused earlier, by the reader, before the first batch: producer/readers.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from workers.dataset.quality_gates import thresholds
from workers.dataset.store import LocalStore, Store
from workers.errors import InputError


@contextmanager
def refused_unstaged(store: Store, job: str, new: bool) -> Iterator[None]:
    """Delete what was staged for a new job ``job`` when the block refuses its input."""
    try:
        yield
    except InputError:
        if new:
            for key in store.list(f"jobs/{job}/inputs/"):
                store.delete(key)
            _remove_empty_folders(store, job)
        raise


def _remove_empty_folders(store: Store, job: str) -> None:
    """A folder store keeps the folders of the objects it deleted (an object store has
    none): remove the refused job's, where they are empty."""
    local = getattr(store, "inner", store)  # a RetryingStore's own store
    if not isinstance(local, LocalStore):
        return
    for folder in (local.root / "jobs" / job / "inputs", local.root / "jobs" / job):
        with suppress(OSError):  # not empty (or not there): left as it is
            folder.rmdir()


def check_kept(source: str, keep: Any) -> None:
    """InputError for a --keep-columns name that no row has (JSONL) or no part's schema has."""
    if keep is None or keep.every:
        return
    absent = [n for n in keep.wanted if n not in keep.arrow and not keep.kinds.get(n)]
    if absent:
        names = ", ".join(repr(n) for n in absent)
        raise InputError(source, None, f"--keep-columns: no row has the column {names}")


def check_quarantine(source: str, bad_rows: list[str], total: int,
                     quality: dict[str, float], allowed: bool) -> None:
    """InputError when more rows are quarantined at read time than the job's
    failed_or_quarantined gate allows, unless ``allowed`` (--allow-quarantine)."""
    limit = thresholds(quality)["failed_or_quarantined"]
    if allowed or not bad_rows or limit >= 1 or len(bad_rows) / total <= limit:
        return
    raise InputError(source, None, (
        f"{len(bad_rows):,} of {total:,} rows ({len(bad_rows) / total:.1%}) would be "
        f"quarantined, over the failed_or_quarantined gate ({limit:.1%}); first: "
        f"{bad_rows[0]}; fix the input, or pass --allow-quarantine"))


def check_staged(source: str, bad_rows: list[str], total: int, job_input: Any) -> None:
    """Every refusal made once a new job's rows are read (see the module docstring)."""
    check_kept(source, job_input.keep)
    check_quarantine(source, bad_rows, total, job_input.quality, job_input.allow_quarantine)
