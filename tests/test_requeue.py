"""From a failed quality gate to a passing data set, and a job that stops its GPUs itself.

``fleet requeue --where`` regenerates exactly the rows a per-row figure names, each once, into
the data set's next version, under a node that dies mid-requeue (the chaos schedules' SIGKILL
of a worker's process group, tests/chaos/cluster.py); ``enqueue --on-quality-warning pause``
pauses the job within one batch of its live gate failing.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import orjson
import pytest
import redis

from tests.chaos.cluster import signal_group
from tests.chaos.schedule import Shape
from tests.conftest import follow_status, run_producer, wait_done, write_prompts
from workers.dataset.jobs import decode_rows, encode_rows, load_spec, result_key
from workers.dataset.quality import judge
from workers.dataset.quality_options import job_options
from workers.dataset.samples import row_key
from workers.dataset.store import LocalStore
from workers.dataset.verify import stored_batches
from workers.delivery.job_progress import dataset_state
from workers.redisdb.keys import JobKeys


def _store(env: dict[str, str]) -> LocalStore:
    return LocalStore(Path(env["FLEET_STORE_URL"].removeprefix("file://")))


def _rows(store: LocalStore, job: str) -> dict[str, dict]:
    """Every stored result row of ``job`` by (index, sample)."""
    out: dict[str, dict] = {}
    for b in stored_batches(store, job):
        for row in decode_rows(store.get(result_key(job, b))):
            assert row_key(row) not in out, f"{row_key(row)} stored twice"
            out[row_key(row)] = row
    return out


def _wait_dataset(r: redis.Redis, job: str, want: str, timeout_s: float = 180) -> None:
    """Until the job's data set is ``want`` (``committed v2``), as the sink's hash says."""
    deadline, got = time.monotonic() + timeout_s, None
    while (got := dataset_state(r.hgetall(JobKeys(job).sink))[0]) != want:
        assert time.monotonic() < deadline, f"job {job}: data set {got}, not {want}"
        time.sleep(0.3)


def _verify(env: dict[str, str], job: str) -> tuple[int, dict]:
    res = run_producer(env, "verify", "--job", job, "--json")
    return res.returncode, orjson.loads(res.stdout)


@pytest.fixture()
def gated_env(fleet_env: dict[str, str]) -> dict[str, str]:
    """The producer with the default quality gates (fleet_env turns them off)."""
    return {k: v for k, v in fleet_env.items() if k != "FLEET_QUALITY"}


def test_requeue_where_near_empty_repairs_a_tenth_of_the_rows_under_a_killed_node(
        gated_env, make_workers, tmp_path, r):
    # Answers of ~400 tokens (the sim's short default here would be near-empty by length).
    fast = {**Shape().worker_env(), "FLEET_SIM_SPEED": "20"}
    (first,) = make_workers([0], **fast)
    src = write_prompts(tmp_path / "p.jsonl", 100)
    assert run_producer(gated_env, "enqueue", str(src), "--job", "rep", "--batch-size",
                        "20").returncode == 0
    _wait_dataset(r, "rep", "committed v1")
    code, before = _verify(gated_env, "rep")
    assert code == 0 and before["quality"]["ok"], before["quality"]["failed"]
    first.stop()

    # The model answered whitespace for every tenth prompt (the seed team's disaster, 10 %).
    store = _store(gated_env)
    for b in stored_batches(store, "rep"):
        rows = decode_rows(store.get(result_key("rep", b)))
        for row in rows:
            if row["index"] % 10 == 3:
                row.update(completion="\n", completion_tokens=1)
        store.put(result_key("rep", b), encode_rows(rows, compress=False))
    # Rows the sim itself answered short (its length draw) are near-empty too: requeued as well.
    opts = job_options(load_spec(store, "rep"), 10)
    rows = _rows(store, "rep")
    redo = {k for k, v in rows.items() if "near_empty" in judge(v, opts).flags}
    assert {k for k, v in rows.items() if v["index"] % 10 == 3} <= redo and len(redo) <= 11
    code, bad = _verify(gated_env, "rep")
    near = bad["quality"]["figures"]["near_empty"]
    assert code == 5 and (near["count"], near["of"]) == (len(redo), 100)
    kept = {k: v for k, v in rows.items() if k not in redo}

    res = run_producer(gated_env, "requeue", "--job", "rep", "--where",
                       "near_empty,truncated,failed")
    assert res.returncode == 0, res.stderr
    assert f"requeued {len(redo)} rows (near_empty {len(redo)}) in 5 batches" in res.stderr
    kept_in = {b: sum(1 for v in kept.values() if v["batch"] == b) for b in range(5)}

    # A slow node takes the requeued batches and dies (its whole process group) mid-requeue.
    (slow,) = make_workers([1], **{**fast, "FLEET_SIM_SPEED": "0.5"})
    deadline = time.monotonic() + 90
    while not any(r.hlen(JobKeys("rep").progress(b)) > kept_in[b] for b in range(5)):
        assert time.monotonic() < deadline, "no requeued row regenerated"
        time.sleep(0.1)
    assert len(stored_batches(store, "rep")) < 5  # mid-requeue
    signal_group(slow.proc.pid, signal.SIGKILL)
    slow.proc.wait(timeout=10)
    make_workers([2], **fast)
    _wait_dataset(r, "rep", "committed v2")

    code, after = _verify(gated_env, "rep")
    assert code == 0, after["quality"]["failed"]
    # 0 lost, 0 doubled
    assert (after["rows"], after["missing"], after["duplicates"]) == (100, 0, 0)
    now = _rows(store, "rep")
    assert len(now) == 100
    assert {k: v for k, v in now.items() if k not in redo} == kept  # untouched
    redone = [v for k, v in now.items() if k in redo and v["index"] % 10 == 3]
    assert len(redone) == 10 and all(v["completion"].strip() for v in redone)
    manifest = orjson.loads((Path(gated_env["FLEET_STORE_URL"].removeprefix("file://"))
                             / "jobs/rep/manifest.json").read_bytes())
    assert manifest["quality"]["ok"] and manifest["complete"]


def test_requeue_names_only_per_row_figures(gated_env, r):
    res = run_producer(gated_env, "requeue", "--job", "nojob", "--where", "near_empty,identical")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "identical" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_job_told_to_pause_pauses_within_one_batch_of_its_live_gate_failing(
        gated_env, make_workers, tmp_path, r):
    batch = 20
    # One batch held at a time, so "within one batch" is what the count shows (a worker that
    # holds several lets each of those it holds finish, as pause does).
    (worker,) = make_workers([0], FLEET_SIM_ANSWER="near-empty", FLEET_QUALITY_EARLY_ROWS="30",
                             FLEET_SIM_SPEED="5", FLEET_SIM_MEAN_OUTPUT_TOKENS="200",
                             FLEET_BATCHES_PER_GPU="1")
    src = write_prompts(tmp_path / "p.jsonl", 400)
    env = {**gated_env, "FLEET_QUALITY_EARLY_ROWS": "30"}
    assert run_producer(env, "enqueue", str(src), "--job", "stop", "--batch-size", str(batch),
                        "--on-quality-warning", "pause").returncode == 0
    st = follow_status(env, "stop", lambda st: st["state"] == "paused", 120, "a pause")
    assert st["paused_by"].startswith("quality warning: near_empty")
    # Batches running when the gate failed finish; no other starts.
    held = st["in_flight_batches"]
    time.sleep(6)
    settled = orjson.loads(run_producer(env, "status", "--job", "stop", "--json").stdout)
    assert settled["state"] == "paused"
    live_rows = int(r.hget(JobKeys("stop").quality, "rows"))
    stored = len(stored_batches(_store(env), "stop"))
    # The gate fails once the tally holds 30 rows (in the second batch at the latest): what
    # ran after it is the batches in flight then, one per running batch at most.
    assert stored <= -(-30 // batch) + max(held, 1), (stored, held)
    assert settled["done_batches"] == stored < 20
    assert live_rows <= (stored + max(held, 1)) * batch
    assert "paused on its quality warning" in worker.log_path.read_text()
    # The operator goes on: resume, the job runs to its end (not paused again for that gate).
    assert run_producer(env, "resume", "--job", "stop").returncode == 0
    done = wait_done(env, "stop", 180)
    assert done["state"] == "done" and done["completed"] == 400
