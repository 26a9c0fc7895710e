"""The claim check cannot be poisoned: fingerprint first, a sha256 per staged batch in the job
record, checked by the worker; ``enqueue`` re-stages what is missing or corrupt."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from celery import Celery

from producer.enqueue import JobInput, enqueue
from producer.readers import read_rows
from producer.requeue import requeue_failed
from tests.conftest import write_prompts
from tests.test_sink import make_job, prompt_rows
from workers.dataset.jobs import (
    SamplingSpec,
    encode_rows,
    input_key,
    load_checked_input,
    load_spec,
    save_spec,
)
from workers.dataset.store import LocalStore
from workers.errors import JobError


@pytest.fixture()
def app(redis_server) -> Celery:
    """A Celery app on the test's real Redis (enqueue sends its tasks there)."""
    return Celery("staging-test", broker=redis_server.url)


def run_enqueue(store: LocalStore, r, app: Celery, path: Path, job: str = "st"):
    """``enqueue`` in-process with batches of 10."""
    return enqueue(store, r, app, JobInput(path, job, 10, SamplingSpec(), read_rows(path)))


def inputs(store: LocalStore, job: str = "st") -> dict[str, bytes]:
    """Every staged object of the job, by key."""
    return {k: store.get(k) for k in store.list(f"jobs/{job}/inputs/")}


def test_a_changed_input_is_refused_before_anything_is_staged(tmp_path, r, app):
    store = LocalStore(tmp_path / "store")
    original = write_prompts(tmp_path / "a.jsonl", 40)
    report = run_enqueue(store, r, app, original)
    spec = report.spec
    assert len(spec.input_sha256) == spec.n_batches == 4
    store.delete(input_key("st", 2))  # a batch lost (or never written by a killed enqueue)
    before = inputs(store)
    changed = write_prompts(tmp_path / "b.jsonl", 40, start=1000)
    with pytest.raises(JobError, match="fingerprint mismatch"):
        run_enqueue(store, r, app, changed)
    assert inputs(store) == before  # nothing of the changed file was written
    again = run_enqueue(store, r, app, original)
    assert again.staged == 1  # the missing batch, from the original file
    rows = load_checked_input(store, load_spec(store, "st"), 2)
    assert [x.id for x in rows] == [f"p{i}" for i in range(20, 30)]


def test_a_corrupt_staged_batch_is_refused_by_the_worker_and_restaged(tmp_path, r, app):
    store = LocalStore(tmp_path / "store")
    path = write_prompts(tmp_path / "a.jsonl", 30)
    spec = run_enqueue(store, r, app, path).spec
    good = load_checked_input(store, spec, 1)
    damaged = store.get(input_key("st", 1))
    store.put(input_key("st", 1), damaged[: len(damaged) // 2])  # cut short
    with pytest.raises(JobError, match="batch 1 is corrupt"):
        load_checked_input(store, spec, 1)
    other = gzip.compress(encode_rows([x.model_dump() | {"id": "evil"} for x in good], False))
    store.put(input_key("st", 1), other)  # valid gzip JSONL, other content
    with pytest.raises(JobError, match="sha256 differs"):
        load_checked_input(store, spec, 1)
    report = run_enqueue(store, r, app, path)
    assert report.staged == 1
    assert load_checked_input(store, load_spec(store, "st"), 1) == good


def test_staged_indices_must_be_the_batch_range(tmp_path):
    store = LocalStore(tmp_path / "store")
    spec = make_job(store, "rg", prompt_rows(30), batch_size=10)
    store.put(input_key("rg", 1), store.get(input_key("rg", 0)))  # batch 0's rows in batch 1
    legacy = spec.model_copy(update={"input_sha256": []})  # a job record without hashes
    with pytest.raises(JobError, match="does not hold the batch's indices 10..19"):
        load_checked_input(store, legacy, 1)
    with pytest.raises(JobError, match="sha256 differs"):
        load_checked_input(store, spec, 1)


def test_requeue_with_a_new_cap_records_the_new_sha256(tmp_path, r, app):
    store = LocalStore(tmp_path / "store")
    spec = make_job(store, "cap", prompt_rows(30), batch_size=10)
    save_spec(store, spec)
    report = requeue_failed(store, r, app, spec, False, 99)
    assert report.batches > 0
    spec = load_spec(store, "cap")
    rows = load_checked_input(store, spec, 0)  # the worker accepts the rewritten batch
    assert rows[5].params == {"max_new_tokens": 99}
