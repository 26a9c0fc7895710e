"""The sink: per-batch results -> Parquet shards, manifest.json and _SUCCESS (local store)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from config.launch_profile import ProfileError, load_profile
from producer.enqueue import EnqueueReport, stage
from producer.localfleet import stop_process
from tests.conftest import ROOT, run_producer, write_prompts
from workers.dataset.jobs import (
    JobSpec,
    PromptRow,
    SamplingSpec,
    encode_rows,
    load_batch_input,
    result_key,
    save_spec,
)
from workers.dataset.manifest import (
    SCHEMA,
    committed_prefix,
    launch_digest,
    manifest_key,
    success_key,
)
from workers.dataset.sink import ShardLimits, aggregate
from workers.dataset.store import LocalStore, Store
from workers.errors import StoreError
from workers.retry import RetryPolicy


def local_root(env: dict[str, str]) -> Path:
    """The folder of a ``fleet_env`` file store."""
    return Path(env["FLEET_STORE_URL"].removeprefix("file://"))


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m producer ARGS`` in this process (fast; ``run_producer`` starts a new one)."""
    from typer.testing import CliRunner

    from producer.cli import cli as app

    res = CliRunner().invoke(app, list(args), env=env)
    if res.exception and not isinstance(res.exception, SystemExit):
        raise res.exception
    return subprocess.CompletedProcess(list(args), res.exit_code, res.stdout, res.stderr)


def wait_job(env: dict[str, str], job: str, timeout_s: float = 90) -> dict[str, Any]:
    """``tests.conftest.wait_done`` with in-process status calls (no interpreter per poll)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = orjson.loads(cli(env, "status", "--job", job, "--json").stdout)
        if st["done"]:
            return dict(st)
        assert time.monotonic() < deadline, f"job {job} not done after {timeout_s} s: {st}"
        time.sleep(0.3)


def prompt_rows(n: int, start: int = 0) -> list[PromptRow]:
    """Rows like tests.conftest.write_prompts writes (plain prompts and chats mixed)."""
    return [
        PromptRow(index=i - start, id=f"p{i}", prompt=f"Question {i}: why?")
        if i % 2
        else PromptRow(
            index=i - start, id=f"p{i}", messages=[{"role": "user", "content": f"Hi {i}"}]
        )
        for i in range(start, start + n)
    ]


def default_fail(index: int) -> bool:
    """Which rows fake results fail: every 11th."""
    return index % 11 == 5


def fake_result(
    spec: JobSpec,
    batch: int,
    row: PromptRow,
    profile: str = "qwen36-27b",
    fail: Callable[[int], bool] = default_fail,
) -> dict[str, Any]:
    """A result row as a worker writes it; every 7th truncated, ``fail`` rows failed."""
    failed = row.error is not None or fail(row.index)
    return {
        "job": spec.name,
        "batch": batch,
        "index": row.index,
        "id": row.id,
        "prompt": row.prompt,
        "messages": row.messages,
        "completion": None if failed else f"answer to {row.id}",
        "reasoning": None if failed else "thinking",
        "finish_reason": None if failed else ("length" if row.index % 7 == 3 else "stop"),
        "prompt_tokens": 0 if failed else 12,
        "completion_tokens": 0 if failed else 30,
        "latency_s": None if failed else 0.25,
        "status": "failed" if failed else "ok",
        "error": (row.error or "engine said no") if failed else None,
        "profile": profile,
        "gpu": batch % 2,
        "node": f"gpu{batch % 2}@test",
        "launch_digest": digest_of(profile),
    }


def digest_of(profile: str) -> str | None:
    """The launch digest a worker running ``profile`` (as on disk) records, if it exists."""
    try:
        return launch_digest(load_profile(profile))
    except ProfileError:
        return None


def make_job(
    store: Store,
    name: str,
    rows: list[PromptRow],
    batch_size: int,
    missing: tuple[int, ...] = (),
    profile: str = "qwen36-27b",
    sampling: SamplingSpec | None = None,
    fail: Callable[[int], bool] = default_fail,
) -> JobSpec:
    """Stage ``rows`` as the producer does and store results for every batch not missing."""
    report = EnqueueReport(spec=None, created=True)  # type: ignore[arg-type]
    staged = [row.model_dump(exclude_defaults=True) for row in rows]  # as producer.readers
    total, n, fingerprint = stage(store, name, staged, batch_size, report, False)
    spec = JobSpec(
        name=name,
        total=total,
        batch_size=batch_size,
        n_batches=n,
        input_path="prompts.jsonl",
        input_fingerprint=fingerprint,
        sampling=sampling or SamplingSpec(max_new_tokens=64),
        created_at=1_700_000_000.0,
        input_sha256=report.batch_sha256,
    )
    save_spec(store, spec)
    for b in range(n):
        if b not in missing:
            write_results(store, spec, b, profile, fail)
    return spec


def write_results(
    store: Store,
    spec: JobSpec,
    batch: int,
    profile: str = "qwen36-27b",
    fail: Callable[[int], bool] = default_fail,
) -> None:
    """Store fake results for one batch of ``spec``."""
    got = [
        fake_result(spec, batch, row, profile, fail)
        for row in load_batch_input(store, spec.name, batch)
    ]
    store.put(result_key(spec.name, batch), encode_rows(got, compress=False))


def job_files(store: LocalStore, job: str) -> dict[str, bytes]:
    """Every object the sink writes for ``job``, by key."""
    keys = [
        k
        for k in store.list(f"jobs/{job}/")
        if "/data/" in k or k.endswith(("manifest.json", "_SUCCESS"))
    ]
    return {k: store.get(k) for k in keys}


def by_name(files: dict[str, bytes]) -> dict[str, bytes]:
    """Shard objects by file name (the version prefix differs between stores)."""
    return {k.rsplit("/", 1)[-1]: v for k, v in files.items()}


@pytest.fixture()
def store(tmp_path: Path) -> LocalStore:
    """An empty local store."""
    return LocalStore(tmp_path / "store")


def test_shards_hold_every_row_once_sorted_and_cut_at_batch_boundaries(store):
    spec = make_job(store, "j1", prompt_rows(230), batch_size=20)
    summary = aggregate(store, "j1", ShardLimits(rows=50))
    assert summary["complete"] and summary["rows"] == 230 and summary["shards"] == 4
    manifest = orjson.loads(store.get(manifest_key("j1")))
    assert manifest["store"]["where"] == "node"  # a folder: says the data is on this machine
    all_indices = []
    for n, shard in enumerate(manifest["shards"]):
        assert shard["key"] == f"{manifest['data_prefix']}part-{n:05d}.parquet"
        assert manifest["data_prefix"] == f"jobs/j1/data/{manifest['version']}/"
        data = store.get(shard["key"])
        assert (len(data), hashlib.sha256(data).hexdigest()) == (shard["bytes"], shard["sha256"])
        table = pq.read_table(store.root / shard["key"])
        assert table.schema.equals(SCHEMA)
        indices = table.column("index").to_pylist()
        assert indices == sorted(indices) and len(indices) == shard["rows"]
        assert (indices[0], indices[-1]) == (shard["first_index"], shard["last_index"])
        assert shard["first_index"] == shard["first_batch"] * 20  # whole batches only
        assert (shard["last_index"] + 1) % 20 == 0 or shard["last_index"] == 229
        all_indices += indices
    assert all_indices == list(range(230))
    assert [s["rows"] for s in manifest["shards"]] == [60, 60, 60, 50]
    assert manifest["totals"] == {**manifest["totals"], "rows": 230, "shards": 4}
    assert manifest["params"]["sampling"]["max_new_tokens"] == 64
    assert manifest["params"]["input_fingerprint"] == spec.input_fingerprint
    assert manifest["params"]["profiles"] == {
        "qwen36-27b": {"rows": 230, "model": "Qwen/Qwen3.6-27B"}
    }
    assert manifest["created_at"] == "2023-11-14T22:13:20Z"
    assert (
        store.get(success_key("j1")).strip().decode()
        == hashlib.sha256(store.get(manifest_key("j1"))).hexdigest()
    )


def test_failed_rows_stay_in_the_data_set_and_are_counted(store):
    rows = prompt_rows(60)
    rows[8] = PromptRow(index=8, id="p8", error="line 9: no 'prompt' or 'messages'")
    make_job(store, "j2", rows, batch_size=25)
    summary = aggregate(store, "j2", ShardLimits())
    table = pq.read_table(store.root / committed_prefix(store, "j2"))
    failed = [r for r in table.to_pylist() if r["status"] == "failed"]
    assert {r["index"] for r in failed} == {5, 8, 16, 27, 38, 49}
    assert all(r["error"] and r["completion"] is None for r in failed)
    truncated = {i for i in range(60) if i % 7 == 3} - {5, 8, 16, 27, 38, 49}
    assert summary["counts"] == {
        "ok": 60 - 6 - len(truncated),
        "truncated": len(truncated),
        "failed": 5,
        "quarantined": 1,
        "reused": 0,
    }
    chats = [r for r in table.to_pylist() if r["messages"]]
    assert chats[0]["messages"] == [{"role": "user", "content": "Hi 0"}]


def test_aggregating_twice_writes_identical_bytes_and_drops_stale_shards(store):
    make_job(store, "j3", prompt_rows(120), batch_size=10)
    aggregate(store, "j3", ShardLimits(rows=30))
    first = job_files(store, "j3")
    time.sleep(0.01)
    aggregate(store, "j3", ShardLimits(rows=30))
    assert job_files(store, "j3") == first and len(first) == 4 + 2
    aggregate(store, "j3", ShardLimits(rows=1000))  # fewer, larger shards now
    assert sorted(k for k in job_files(store, "j3") if "/data/" in k) == [
        f"{committed_prefix(store, 'j3')}part-00000.parquet"
    ]


def test_size_target_cuts_shards_once_a_file_reaches_it(store):
    make_job(store, "j4", prompt_rows(400), batch_size=20)
    summary = aggregate(store, "j4", ShardLimits(target_bytes=6000, row_group_bytes=3000))
    manifest = orjson.loads(store.get(manifest_key("j4")))
    assert summary["shards"] > 2 and summary["rows"] == 400
    assert all(s["bytes"] >= 6000 for s in manifest["shards"][:-1])
    assert pq.ParquetFile(store.root / manifest["shards"][0]["key"]).num_row_groups > 1


def test_no_success_marker_until_verify_passes(store):
    spec = make_job(store, "j5", prompt_rows(50), batch_size=10, missing=(3,))
    summary = aggregate(store, "j5", ShardLimits())
    assert not summary["complete"] and summary["missing"] == 10 and summary["rows"] == 40
    assert not store.exists(success_key("j5"))
    assert orjson.loads(store.get(manifest_key("j5")))["complete"] is False
    write_results(store, spec, 3)
    assert aggregate(store, "j5", ShardLimits())["complete"]
    assert store.exists(success_key("j5"))
    store.delete(result_key("j5", 0))  # e.g. requeue-failed reopened a batch
    assert not aggregate(store, "j5", ShardLimits())["complete"]
    assert not store.exists(success_key("j5"))


class Flaky:
    """A store whose first call for each key fails, after half-reading or half-writing a stream."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner, self.url = inner, inner.url
        self.failed: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # the sink reads ahead in threads

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.inner, name)

        def call(*args: Any) -> Any:
            with self._lock:
                first = (name, str(args[0])) not in self.failed
                self.failed.add((name, str(args[0])))
            if first:
                if name == "put_stream":
                    args[1].read(100)
                if name == "get_into":
                    args[1].write(b"junk")
                raise StoreError(f"flaky {name}")
            return fn(*args)

        return call


def test_store_errors_are_retried_and_change_no_byte(store, tmp_path):
    make_job(store, "j7", prompt_rows(100), batch_size=10)
    aggregate(store, "j7", ShardLimits(rows=30))
    clean = job_files(store, "j7")
    flaky = Flaky(LocalStore(tmp_path / "other"))
    for key in store.list("jobs/j7/"):
        if "/data/" not in key and not key.endswith(("manifest.json", "_SUCCESS")):
            flaky.inner.put(key, store.get(key))
    aggregate(flaky, "j7", ShardLimits(rows=30), RetryPolicy(max_attempts=3, base_s=0, max_s=0))
    assert len(flaky.failed) > 20
    again = job_files(flaky.inner, "j7")
    manifest = orjson.loads(again.pop(manifest_key("j7")))
    expected = orjson.loads(clean.pop(manifest_key("j7")))
    assert again.pop(success_key("j7")) and clean.pop(success_key("j7"))
    assert by_name(again) == by_name(clean)  # the shards, byte for byte (other versions)
    assert manifest["digest"] == expected["digest"] and manifest["counts"] == expected["counts"]


def test_finished_at_is_kept_while_the_data_set_is_unchanged(store):
    spec = make_job(store, "j6", prompt_rows(30), batch_size=10, missing=(2,))
    aggregate(store, "j6", ShardLimits())
    before = orjson.loads(store.get(manifest_key("j6")))["finished_at"]
    time.sleep(1.1)
    aggregate(store, "j6", ShardLimits())
    assert orjson.loads(store.get(manifest_key("j6")))["finished_at"] == before
    write_results(store, spec, 2)
    aggregate(store, "j6", ShardLimits())
    assert orjson.loads(store.get(manifest_key("j6")))["finished_at"] > before


def test_sink_command_local_and_exit_codes(fleet_env, r):
    store = LocalStore(local_root(fleet_env))
    make_job(store, "ok", prompt_rows(40), batch_size=10)
    make_job(store, "part", prompt_rows(40), batch_size=10, missing=(1,))
    res = run_producer(fleet_env, "sink", "--job", "ok", "--local", "--json")
    assert res.returncode == 0, res.stderr
    assert orjson.loads(res.stdout)["rows"] == 40
    res = cli(fleet_env, "sink", "--job", "part", "--local")
    assert res.returncode == 1 and "complete=False" in res.stderr
    res = cli(fleet_env, "sink", "--job", "nope", "--local")
    assert res.returncode == 3 and "no job 'nope'" in res.stderr




def test_last_batch_triggers_the_sink_worker(fleet_env, make_workers, tmp_path, r):
    log = (tmp_path / "sink.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", "sink", "-n",
         "sink@test", "--concurrency", "1", "--loglevel", "INFO"],
        env=fleet_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        make_workers([0])
        prompts = write_prompts(tmp_path / "prompts.jsonl", 60)
        res = run_producer(fleet_env, "enqueue", str(prompts), "--job", "auto",
                           "--batch-size", "20")
        assert res.returncode == 0, res.stderr
        store = LocalStore(local_root(fleet_env))
        deadline = time.monotonic() + 60
        while not store.exists(success_key("auto")):  # nobody asked: the last batch did
            assert time.monotonic() < deadline, (tmp_path / "sink.log").read_text()[-3000:]
            assert worker.poll() is None, (tmp_path / "sink.log").read_text()[-3000:]
            time.sleep(0.2)
        first = job_files(store, "auto")
        res = run_producer(fleet_env, "sink", "--job", "auto", "--wait", "--timeout", "40",
                           "--json")
        assert res.returncode == 0, res.stderr
        assert orjson.loads(res.stdout)["rows"] == 60 and job_files(store, "auto") == first
    finally:
        stop_process(worker, grace_s=10)
        log.close()
