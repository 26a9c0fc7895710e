"""The pipeline end to end: producer -> Redis -> GPU workers owning engines -> store."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import orjson
import pytest
import redis

from tests.conftest import run_producer, wait_done, write_prompts
from workers.node.heartbeat import read_heartbeats


def _engine_pids(guard_pid: int) -> list[int]:
    """Children of the engine guard (the engine process itself)."""
    path = Path(f"/proc/{guard_pid}/task/{guard_pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_job_of_600_prompts_through_two_workers_verifies(fleet_env, make_workers, tmp_path, r):
    make_workers([0, 1])
    prompts = write_prompts(tmp_path / "prompts.jsonl", 600)
    res = run_producer(fleet_env, "enqueue", str(prompts), "--job", "e2e", "--batch-size", "50",
                       "--max-new-tokens", "200")
    assert res.returncode == 0, res.stderr
    assert "enqueued 12" in res.stderr
    st = wait_done(fleet_env, "e2e")
    assert st["completed"] + st["failed"] == 600
    res = run_producer(fleet_env, "verify", "--job", "e2e", "--json")
    report = orjson.loads(res.stdout)
    assert res.returncode == 0, report
    assert report == {**report, "expected": 600, "rows": 600, "unique": 600, "duplicates": 0,
                      "missing": 0, "ok": True}
    assert report["failed"] == st["failed"] == 0
    # Both GPUs took work from the shared queue, and rows carry what was promised.
    store = Path(fleet_env["FLEET_STORE_URL"].removeprefix("file://"))
    rows = [orjson.loads(line) for f in sorted((store / "jobs/e2e/results").glob("*.jsonl"))
            for line in f.read_bytes().splitlines()]
    assert {row["gpu"] for row in rows} == {0, 1}
    first = rows[0]
    for key in ("job", "index", "id", "completion", "finish_reason", "prompt_tokens",
                "completion_tokens", "latency_s", "profile"):
        assert first[key] is not None, key
    assert first["profile"] == "qwen36-27b"
    assert [row["index"] for row in rows] == list(range(600))


@pytest.mark.parametrize("version", ["0.5.23", "0.5.24"])
def test_a_job_runs_on_a_current_release_and_its_cap_is_read(fleet_env, make_workers, tmp_path,
                                                             r, version):
    """The engine plays 0.5.23's formats (issue #21), or a release newer than any known, which
    the worker starts with one warning: the job completes and the cap comes from /v1/loads."""
    (worker,) = make_workers([0], FLEET_SIM_SGLANG_VERSION=version)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    res = run_producer(fleet_env, "enqueue", str(prompts), "--job", "rel", "--batch-size", "20",
                       "--max-new-tokens", "40")
    assert res.returncode == 0, res.stderr
    st = wait_done(fleet_env, "rel")
    assert st["completed"] == 40 and st["failed"] == 0
    report = orjson.loads(run_producer(fleet_env, "verify", "--job", "rel", "--json").stdout)
    assert report["ok"] and report["rows"] == 40
    deadline = time.monotonic() + 20
    while read_heartbeats(r)[0].get("cap") != 40:  # 200 Mamba slots // R = 5 (the profile)
        assert time.monotonic() < deadline, read_heartbeats(r)
        time.sleep(0.2)
    engine_log = (Path(fleet_env["FLEET_LOG_DIR"]) / "engine-gpu0.log").read_text()
    assert "KV Cache is allocated. dtype: torch.bfloat16, #tokens: " in engine_log
    assert "Capture target verify CUDA graph end. bs=[" in engine_log
    worker_log = worker.log_path.read_text()
    warned = [line for line in worker_log.splitlines() if "newer than" in line]
    assert len(warned) == (version == "0.5.24") and "does not support" not in worker_log


def test_enqueue_twice_enqueues_nothing_the_second_time(fleet_env, tmp_path, r):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 120)
    first = run_producer(fleet_env, "enqueue", str(prompts), "--job", "twice",
                         "--batch-size", "25")
    assert first.returncode == 0, first.stderr
    assert "enqueued 5" in first.stderr
    queued = r.llen("gpu")
    second = run_producer(fleet_env, "enqueue", str(prompts), "--job", "twice")
    assert second.returncode == 0, second.stderr
    assert "enqueued 0" in second.stderr and "already pending 5" in second.stderr
    assert r.llen("gpu") == queued == 5


def test_worker_on_gpu1_pins_its_engine_to_gpu1_on_its_port(fleet_env, make_workers, r):
    (worker,) = make_workers([1])
    (beat,) = read_heartbeats(r)
    base = int(fleet_env["FLEET_ENGINE_BASE_PORT"])
    assert (beat["gpu"], beat["port"]) == (1, base + 1)
    (engine_pid,) = _engine_pids(beat["engine_pid"])
    env = _environ(engine_pid)
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    cmdline = Path(f"/proc/{engine_pid}/cmdline").read_bytes().split(b"\0")
    assert b"workers.sim" in cmdline
    assert cmdline[cmdline.index(b"--port") + 1] == str(base + 1).encode()
    assert cmdline[cmdline.index(b"--host") + 1] == b"127.0.0.1"


def test_engine_killed_mid_batch_restarts_and_job_completes(fleet_env, make_workers, tmp_path,
                                                            r):
    make_workers([0], FLEET_SIM_SPEED="3")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 300)
    res = run_producer(fleet_env, "enqueue", str(prompts), "--job", "crash",
                       "--batch-size", "100")
    assert res.returncode == 0, res.stderr
    deadline = time.monotonic() + 60
    while int(r.hget("fleet:job:crash:stats", "completed") or 0) < 20:
        assert time.monotonic() < deadline, "no progress before the kill"
        time.sleep(0.1)
    (beat,) = read_heartbeats(r)
    (engine_pid,) = _engine_pids(beat["engine_pid"])
    os.kill(engine_pid, signal.SIGKILL)
    st = wait_done(fleet_env, "crash", timeout_s=180)
    assert st["completed"] == 300 and st["failed"] == 0
    (beat,) = read_heartbeats(r)
    assert beat["engine_restarts"] >= 1
    report = orjson.loads(run_producer(fleet_env, "verify", "--job", "crash", "--json").stdout)
    assert report["ok"] and report["duplicates"] == 0 and report["missing"] == 0


def test_sigkill_of_worker_leaves_no_orphan_engine(make_workers, r):
    (worker,) = make_workers([0])
    (beat,) = read_heartbeats(r)
    guard = beat["engine_pid"]
    (engine_pid,) = _engine_pids(guard)
    worker.kill()
    deadline = time.monotonic() + 45
    while _alive(engine_pid) or _alive(guard):
        assert time.monotonic() < deadline, "engine outlived its worker"
        time.sleep(0.2)


def test_bad_input_file_gets_one_line_error_and_exit_code_2(fleet_env, tmp_path, r):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "fine"}\n{"prompt": broken\n')
    res = run_producer(fleet_env, "enqueue", str(bad), "--job", "bad")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert f"{bad}:3" in lines[0] and "Traceback" not in res.stderr
    missing = run_producer(fleet_env, "enqueue", str(tmp_path / "nope.jsonl"), "--job", "bad")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


def test_failed_staging_write_gets_one_line_error_and_exit_code_3(fleet_env, tmp_path, r):
    # The staged batches are written on a background thread: its error still ends the command.
    prompts = write_prompts(tmp_path / "prompts.jsonl", 50)
    inputs = Path(fleet_env["FLEET_STORE_URL"].removeprefix("file://")) / "jobs/full/inputs"
    inputs.parent.mkdir(parents=True)
    inputs.write_text("a file where the batch folder should be")
    res = run_producer(fleet_env, "enqueue", str(prompts), "--job", "full", "--batch-size", "10")
    assert res.returncode == 3, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    # Batches are written several at a time: whichever write fails first is the one named.
    assert re.match(r"error: cannot write \S+/inputs/b\d{6}\.jsonl\.gz: ", lines[0]), lines[0]
    assert r.llen("gpu") == 0


def test_rows_without_a_prompt_are_quarantined_with_a_reason(fleet_env, make_workers, tmp_path,
                                                             r: redis.Redis):
    src = tmp_path / "mixed.jsonl"
    src.write_text('{"prompt": "a"}\n{"text": "no prompt key"}\n'
                   '{"custom_id": "c3", "body": {"messages": [{"role": "user", "content": "x"}],'
                   ' "max_tokens": 5}}\n')
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "mixed")
    assert res.returncode == 0, res.stderr
    assert "quarantined 1" in res.stderr and "line 2" in res.stderr
    make_workers([0])
    st = wait_done(fleet_env, "mixed")
    assert (st["completed"], st["failed"], st["quarantined"]) == (2, 0, 1)
    report = orjson.loads(run_producer(fleet_env, "verify", "--job", "mixed", "--json").stdout)
    assert report["ok"] and (report["failed"], report["quarantined"]) == (0, 1)
    store = Path(fleet_env["FLEET_STORE_URL"].removeprefix("file://"))
    rows = [orjson.loads(x) for x in (store / "jobs/mixed/results/b000000.jsonl").read_bytes()
            .splitlines()]
    assert rows[1]["status"] == "failed" and "no 'prompt' or 'messages'" in rows[1]["error"]
    assert rows[2]["id"] == "c3" and rows[2]["completion_tokens"] <= 5
