"""The data set commits atomically: versioned shards, the manifest as commit point, one lock.

A reader goes through the manifest (``committed_prefix`` / ``python -m producer dataset-path``)
and must see the previous complete version or the new one, never a mix, wherever a sink run
is killed; ``requeue-failed`` and the sink never run at once.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
from celery import Celery

from producer.requeue import requeue_failed
from tests.conftest import ROOT
from tests.test_sink import cli, local_root, make_job, prompt_rows, write_results
from workers.dataset.jobs import decode_rows, load_spec, result_key
from workers.dataset.manifest import (
    committed_prefix,
    data_prefix,
    load_manifest,
    location,
    manifest_key,
    success_key,
    to_record,
)
from workers.dataset.sink import ShardLimits, aggregate
from workers.dataset.sink_lock import LockLost, SinkLock
from workers.dataset.store import LocalStore, Store
from workers.errors import FleetError
from workers.redisdb.keys import JobKeys

LIMITS = ShardLimits(rows=20)
STEPS = ("shards-written", "manifest-written", "success-written", "cleanup")

KILL_AT = """
import os, signal, sys
from pathlib import Path
from workers.dataset.sink import ShardLimits, aggregate
from workers.dataset.store import LocalStore

root, job, at = sys.argv[1:4]

def hook(step):
    if step == at:
        os.kill(os.getpid(), signal.SIGKILL)

aggregate(LocalStore(Path(root)), job, ShardLimits(rows=20), on_step=hook)
"""


@pytest.fixture()
def store(tmp_path: Path) -> LocalStore:
    """An empty local store."""
    return LocalStore(tmp_path / "store")


def read_committed(store: LocalStore, job: str) -> set[tuple[Any, ...]]:
    """The rows a reader gets through the documented path (one ``read_table`` of it)."""
    path = location(store.url, committed_prefix(store, job))
    table = pq.read_table(path)
    rows = [(r["index"], r["status"], r["completion"]) for r in table.to_pylist()]
    assert len(rows) == len(set(rows)), "a row twice"
    return set(rows)


def stored_rows(store: Store, job: str) -> set[tuple[Any, ...]]:
    """The rows the batch results hold now (what a complete new version must contain)."""
    spec = load_spec(store, job)
    out = set()
    for b in range(spec.n_batches):
        for row in decode_rows(store.get(result_key(job, b))):
            rec = to_record(row)
            out.add((rec["index"], rec["status"], rec["completion"]))
    return out


def success_matches(store: Store, job: str) -> bool:
    """``_SUCCESS`` is absent, or vouches for the manifest beside it."""
    if not store.exists(success_key(job)):
        return True
    digest = hashlib.sha256(store.get(manifest_key(job))).hexdigest()
    return store.get(success_key(job)).strip().decode() == digest


def old_and_changed(store: LocalStore, job: str) -> tuple[set[Any], set[Any]]:
    """A committed complete version, then results that differ (every row ok now)."""
    spec = make_job(store, job, prompt_rows(70), batch_size=10)
    assert aggregate(store, job, LIMITS)["complete"]
    old = read_committed(store, job)
    for b in range(spec.n_batches):
        write_results(store, spec, b, fail=lambda i: False)
    new = stored_rows(store, job)
    assert new != old and len(new) == len(old) == 70
    return old, new


@pytest.mark.parametrize("step", STEPS)
def test_a_reader_sees_the_old_or_the_new_version_wherever_the_sink_is_killed(store, step):
    old, new = old_and_changed(store, "kill")
    res = subprocess.run([sys.executable, "-c", KILL_AT, str(store.root), "kill", step],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == -9, res.stderr  # killed at the step, not finished
    seen = read_committed(store, "kill")
    assert seen in (old, new)
    assert seen == (old if step == "shards-written" else new)
    assert success_matches(store, "kill")
    # The next run repairs what the killed one left: one version, complete, _SUCCESS.
    summary = aggregate(store, "kill", LIMITS)
    assert summary["complete"] and read_committed(store, "kill") == new
    assert store.exists(success_key("kill")) and success_matches(store, "kill")
    versions = {k.split("/")[3] for k in store.list(data_prefix("kill"))}
    assert versions == {summary["version"]}


def test_dataset_path_command_prints_the_committed_version(fleet_env, r):
    store = LocalStore(local_root(fleet_env))
    spec = make_job(store, "dp", prompt_rows(40), batch_size=10, missing=(3,))
    res = cli(fleet_env, "dataset-path", "--job", "dp")
    assert res.returncode == 3 and "no data set yet" in res.stderr
    aggregate(store, "dp", LIMITS)
    res = cli(fleet_env, "dataset-path", "--job", "dp")
    assert res.returncode == 3 and "not complete" in res.stderr
    res = cli(fleet_env, "dataset-path", "--job", "dp", "--allow-incomplete")
    assert pq.read_table(res.stdout.strip()).num_rows == 30
    write_results(store, spec, 3)
    aggregate(store, "dp", LIMITS)
    path = cli(fleet_env, "dataset-path", "--job", "dp").stdout.strip()
    manifest = load_manifest(store, "dp")
    assert path == f"{store.root}/{manifest['data_prefix']}"
    assert pq.read_table(path).num_rows == 40


class VanishingResults:
    """A store where batch 2's result is deleted as the results are listed a second time
    (what an unlocked requeue-failed did between the sink's two reads)."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner, self.url, self.lists = inner, inner.url, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def list(self, prefix: str) -> Any:
        if prefix.endswith("/results/"):
            self.lists += 1
            if self.lists == 2:
                self.inner.delete(result_key("gone", 2))
        return self.inner.list(prefix)


def test_completeness_is_decided_from_the_rows_written(store):
    make_job(store, "gone", prompt_rows(30), batch_size=10)
    summary = aggregate(VanishingResults(store), "gone", LIMITS)
    manifest = load_manifest(store, "gone")
    assert manifest["verify"]["unique"] == manifest["totals"]["rows"] == summary["rows"]
    assert summary["complete"] == (summary["rows"] == 30)
    assert store.exists(success_key("gone")) == summary["complete"]


def test_requeue_failed_waits_for_the_sink_and_unmarks_the_data_set(store, r, redis_server):
    spec = make_job(store, "rq", prompt_rows(40), batch_size=10)
    app = Celery("t", broker=redis_server.url)
    r.set(JobKeys("rq").sink_auto, 1)
    in_sink, go_on, done = threading.Event(), threading.Event(), threading.Event()
    results: dict[str, Any] = {}

    def hook(step: str) -> None:
        if step == "shards-written":
            in_sink.set()
            go_on.wait(30)

    def sink() -> None:
        with SinkLock(r, "rq", "sink-run") as lock:
            lock.acquire(5)
            results["sink"] = aggregate(store, "rq", LIMITS, lock=lock, on_step=hook)

    def requeue() -> None:
        results["requeue"] = requeue_failed(store, r, app, spec, False, None)
        done.set()

    threads = [threading.Thread(target=sink)]
    threads[0].start()
    assert in_sink.wait(30)
    threads.append(threading.Thread(target=requeue))
    threads[1].start()
    assert not done.wait(1.5)  # requeue waits for the sink's lock ...
    assert all(store.exists(result_key("rq", b)) for b in range(spec.n_batches))  # ... untouched
    go_on.set()
    for t in threads:
        t.join(60)
    assert results["sink"]["complete"] and results["requeue"].batches > 0
    manifest = load_manifest(store, "rq")
    assert manifest["complete"] is False and manifest["reopened"] is True
    assert not store.exists(success_key("rq"))
    assert r.get(JobKeys("rq").sink_auto) is None  # the last requeued batch triggers again
    with pytest.raises(Exception, match="not complete"):
        committed_prefix(store, "rq")


def test_the_lock_has_one_owner_is_renewed_and_released_only_by_its_owner(r):
    a = SinkLock(r, "lk", "a", ttl_s=0.6)
    b = SinkLock(r, "lk", "b", ttl_s=0.6)
    with a:
        assert a.try_acquire() and not b.try_acquire()
        threading.Event().wait(1.5)  # past two TTLs: renewal keeps it
        assert r.get(JobKeys("lk").sink_lock) == b"a" and not b.try_acquire()
        b.release()  # not the owner: nothing happens
        assert r.get(JobKeys("lk").sink_lock) == b"a"
        with pytest.raises(FleetError, match="held by a"):
            b.acquire(timeout_s=0.3, poll_s=0.1)
    assert r.get(JobKeys("lk").sink_lock) is None
    assert b.try_acquire()
    b.release()


def test_a_run_that_lost_its_lock_commits_nothing_and_deletes_nothing(store, r):
    make_job(store, "lost", prompt_rows(30), batch_size=10)
    aggregate(store, "lost", LIMITS)
    before = {k: store.get(k) for k in store.list("jobs/lost/")}

    def steal(step: str) -> None:
        if step == "shards-written":  # our lock expired; another run took it
            r.set(JobKeys("lost").sink_lock, "other")

    with SinkLock(r, "lost", "mine") as lock, pytest.raises(LockLost):
        lock.acquire(5)
        aggregate(store, "lost", LIMITS, lock=lock, on_step=steal)
    after = {k: store.get(k) for k in store.list("jobs/lost/") if k in before}
    assert after == before
    assert r.get(JobKeys("lost").sink_lock) == b"other"  # our release left the other owner's lock


def test_sink_local_takes_the_same_lock(fleet_env, r):
    store = LocalStore(local_root(fleet_env))
    make_job(store, "busy", prompt_rows(20), batch_size=10)
    r.set(JobKeys("busy").sink_lock, "a-sink-worker")
    res = cli(fleet_env, "sink", "--job", "busy", "--local", "--timeout", "1")
    assert res.returncode == 3 and "being written by another run" in res.stderr
    assert load_manifest(store, "busy") is None
    r.delete(JobKeys("busy").sink_lock)
    res = cli(fleet_env, "sink", "--job", "busy", "--local", "--json")
    assert res.returncode == 0 and orjson.loads(res.stdout)["rows"] == 20
    assert r.get(JobKeys("busy").sink_lock) is None
