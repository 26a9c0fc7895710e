"""``enqueue --reuse-from``: finished rows of an older job are copied, not regenerated."""

from __future__ import annotations

import orjson
import pytest

from config.launch_profile import load_profile
from producer.reuse import apply_reuse
from tests.conftest import run_producer, write_prompts
from tests.test_sink import cli, digest_of, local_root, make_job, prompt_rows, write_results
from workers.dataset.jobs import (
    PromptRow,
    SamplingSpec,
    decode_rows,
    encode_rows,
    load_spec,
    result_key,
)
from workers.dataset.manifest import launch_digest
from workers.dataset.samples import parse_unit_key
from workers.dataset.store import LocalStore
from workers.delivery import jobstate
from workers.delivery.progress import read_progress
from workers.errors import JobError
from workers.redisdb.keys import JobKeys


def test_enqueue_reuse_from_stores_whole_batches_and_prefills_partial_ones(fleet_env, tmp_path, r):
    store = LocalStore(local_root(fleet_env))
    old_src = write_prompts(tmp_path / "old.jsonl", 100)
    res = run_producer(
        fleet_env,
        "enqueue",
        str(old_src),
        "--job",
        "old",
        "--batch-size",
        "20",
        "--max-new-tokens",
        "64",
    )
    assert res.returncode == 0, res.stderr
    old = load_spec(store, "old")
    for b in range(old.n_batches):  # as if workers had run it; row 25 failed
        write_results(store, old, b, fail=lambda i: i == 25)
    new_src = tmp_path / "new.jsonl"  # rows 0-89 of old, then 40 new prompts
    fresh = write_prompts(tmp_path / "fresh.jsonl", 40, start=1000).read_bytes()
    new_src.write_bytes(b"".join(old_src.read_bytes().splitlines(keepends=True)[:90]) + fresh)

    res = run_producer(
        fleet_env,
        "enqueue",
        str(new_src),
        "--job",
        "new",
        "--batch-size",
        "20",
        "--max-new-tokens",
        "64",
        "--reuse-from",
        "old",
    )
    assert res.returncode == 0, res.stderr
    assert "reused 89 rows from job old" in res.stderr
    assert "3 batches stored without a GPU, 2 partly pre-filled" in res.stderr
    assert "enqueued 4, already done 3" in res.stderr  # batches 1 and 4 (partial), 5, 6
    batch0 = decode_rows(store.get(result_key("new", 0)))
    olds = {x["index"]: x for x in decode_rows(store.get(result_key("old", 0)))}
    assert [x["index"] for x in batch0] == list(range(20))
    assert all(x["job"] == "new" and x["reused_from"] == "old" for x in batch0)
    assert [x["completion"] for x in batch0] == [olds[i]["completion"] for i in range(20)]
    keys = JobKeys("new")
    assert sorted(int(i) for i in r.hkeys(keys.progress(1))) == [
        i for i in range(20, 40) if i != 25
    ]
    assert len(r.hkeys(keys.progress(4))) == 10
    assert jobstate.counters(r, "new")["completed"] == 89
    st = orjson.loads(cli(fleet_env, "status", "--job", "new", "--json").stdout)
    assert (st["completed"], st["done_batches"]) == (89, 3)

    again = run_producer(fleet_env, "enqueue", str(new_src), "--job", "new", "--reuse-from", "old")
    assert "enqueued 0, already done 3, already pending 4" in again.stderr
    assert "reused 0 rows" in again.stderr
    assert jobstate.counters(r, "new")["completed"] == 89


def test_reuse_needs_same_sampling_and_profile_and_matches_repeats_once(tmp_path, r):
    store = LocalStore(tmp_path / "store")
    a, b = prompt_rows(2)
    make_job(
        store,
        "src",
        [a, a.model_copy(update={"index": 1, "id": "p0b"}), b.model_copy(update={"index": 2})],
        batch_size=10,
        fail=lambda i: False,
    )
    repeats = [a.model_copy(update={"index": i, "id": f"n{i}"}) for i in range(3)]
    rows = [
        *repeats,
        b.model_copy(update={"index": 3}),
        PromptRow(index=4, id="bad", error="line 5: no 'prompt' or 'messages'"),
    ]
    new = make_job(store, "dst", rows, batch_size=10, missing=(0,))
    report = apply_reuse(store, r, new, "src", "qwen36-27b")
    assert (report.rows, report.batches, report.partial_batches) == (3, 0, 1)
    raw = r.hgetall(JobKeys("dst").progress(0))
    chunks = {parse_unit_key(i): c.decode() for i, c in raw.items()}
    got = {x["index"]: x for x in read_progress(store, "dst", 0, chunks)}
    assert sorted(got) == [0, 1, 3]  # two of three repeats: src has two finished copies
    assert {got[0]["completion"], got[1]["completion"]} == {"answer to p0", "answer to p0b"}
    assert got[3]["completion"] == "answer to p1" and got[3]["id"] == "p1"
    r.flushall()
    hot = make_job(
        store,
        "hot",
        rows,
        batch_size=10,
        missing=(0,),
        sampling=SamplingSpec(max_new_tokens=64, temperature=0.7),
    )
    assert apply_reuse(store, r, hot, "src", "qwen36-27b").rows == 0
    assert apply_reuse(store, r, new, "src", "qwen36-27b-baseline").rows == 0
    whole = make_job(
        store,
        "whole",
        [b.model_copy(update={"index": 0}), rows[4].model_copy(update={"index": 1})],
        batch_size=10,
        missing=(0,),
    )
    assert apply_reuse(store, r, whole, "src", "qwen36-27b").batches == 1
    stored = decode_rows(store.get(result_key("whole", 0)))
    assert [x["status"] for x in stored] == ["ok", "failed"]
    assert stored[1]["error"].startswith("line 5")


def test_reuse_matches_the_launch_digest_not_the_profile_name(tmp_path, r):
    """Rows from workers whose engine ran an edited ``qwen36-27b`` are not this producer's."""
    store = LocalStore(tmp_path / "store")
    rows = prompt_rows(4)
    src = make_job(store, "src", rows, batch_size=10, fail=lambda i: False)
    edited = load_profile("qwen36-27b").with_flags("qwen36-27b", context_length=4096)
    assert edited.name == "qwen36-27b" and launch_digest(edited) != digest_of("qwen36-27b")
    stored = decode_rows(store.get(result_key("src", 0)))
    store.put(result_key("src", 0), encode_rows(
        [x | {"launch_digest": launch_digest(edited)} for x in stored], compress=False))
    dst = make_job(store, "dst", rows, batch_size=10, missing=(0,))
    assert apply_reuse(store, r, dst, "src", "qwen36-27b").rows == 0
    write_results(store, src, 0)  # rows of engines launched as the profile on disk says
    assert apply_reuse(store, r, dst, "src", "qwen36-27b").rows == len(rows)
    with pytest.raises(JobError, match="launch profile 'nope' not found"):
        apply_reuse(store, r, dst, "src", "nope")


def test_reuse_works_per_sample(tmp_path, r):
    """Each (prompt, sample) of the new job reuses the same sample of the old one (its own
    derived seed is part of the match); a sample the old job never drew is generated."""
    from tests.test_sink import fake_result

    store = LocalStore(tmp_path / "store")
    three = SamplingSpec(max_new_tokens=64, temperature=0.8, samples=3)
    src = make_job(store, "src3", prompt_rows(4), batch_size=10, missing=(0,), sampling=three)
    rows = []
    for row in prompt_rows(4):
        for s in range(3):
            rows.append({**fake_result(src, 0, row, fail=lambda i: False), "sample": s,
                         "completion": f"answer {row.index}/{s}"})
    store.put(result_key("src3", 0), encode_rows(rows, compress=False))
    same = make_job(store, "dst3", prompt_rows(4), batch_size=10, missing=(0,), sampling=three)
    report = apply_reuse(store, r, same, "src3", "qwen36-27b")
    assert (report.rows, report.batches) == (12, 1)
    got = decode_rows(store.get(result_key("dst3", 0)))
    assert [(x["index"], x["sample"], x["completion"]) for x in got] == [
        (i, s, f"answer {i}/{s}") for i in range(4) for s in range(3)]
    four = three.model_copy(update={"samples": 4})
    more = make_job(store, "dst4", prompt_rows(4), batch_size=10, missing=(0,), sampling=four)
    report = apply_reuse(store, r, more, "src3", "qwen36-27b")
    assert (report.rows, report.batches, report.partial_batches) == (12, 0, 1)
    fields = {parse_unit_key(k) for k in r.hkeys(JobKeys("dst4").progress(0))}
    assert fields == {(i, s) for i in range(4) for s in range(3)}  # sample 3 is generated


def test_requeue_failed_redoes_the_failed_samples_only(tmp_path, r, redis_server):
    """A prompt with one failed sample of three: requeue-failed reopens that sample alone; the
    other two stay recorded in the batch's progress, so the worker sends one request."""
    from celery import Celery

    from producer.requeue import requeue_failed
    from tests.test_sink import fake_result

    store = LocalStore(tmp_path / "store")
    three = SamplingSpec(max_new_tokens=64, temperature=0.8, samples=3)
    spec = make_job(store, "rq3", prompt_rows(4), batch_size=10, missing=(0,), sampling=three)
    rows = [{**fake_result(spec, 0, row, fail=lambda i: False), "sample": s}
            for row in prompt_rows(4) for s in range(3)]
    rows[4] = {**rows[4], "status": "failed", "error": "engine said no", "completion": None}
    store.put(result_key("rq3", 0), encode_rows(rows, compress=False))
    report = requeue_failed(store, r, Celery("t", broker=redis_server.url), spec, False, None)
    assert report.rows == 1 and not store.exists(result_key("rq3", 0))
    fields = {parse_unit_key(k) for k in r.hkeys(JobKeys("rq3").progress(0))}
    assert fields == {(i, s) for i in range(4) for s in range(3)} - {(1, 1)}
