"""The README's own path, run as a newcomer runs it, and the answers that must be true on it.

``fleet enqueue`` and one ``celery -A workers worker -Q gpu0 -n gpu0@%h`` started from the
project's folder with the default (folder) store and nothing else: no sink worker, no manual
``sink``. Then, from another folder: the job says ``done`` and its clock stops, ``fleet jobs``
agrees, and ``fleet dataset-path`` names the data set the worker committed.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from producer.localfleet import WorkerProcess, wait_healthy
from tests.conftest import ROOT, run_producer, write_prompts
from workers.tune import snapshot
from workers.tune.diagnose import diagnose

SNAPSHOTS = Path(__file__).parent / "fixtures" / "tune" / "snapshots"
MODEL = Path(__file__).parent / "fixtures" / "models" / "qwen36-27b-dummy"


def _fleet(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture()
def readme_env(fleet_env: dict[str, str]) -> dict[str, str]:
    """The test's Redis, ports and simulator, and the default store (no FLEET_STORE_URL)."""
    return {k: v for k, v in fleet_env.items() if k != "FLEET_STORE_URL"}


def test_the_readme_path_ends_done_and_builds_the_data_set(readme_env, tmp_path, r):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    write_prompts(project / "prompts.jsonl", 60)
    res = _fleet(readme_env, project, "enqueue", "prompts.jsonl", "--job", "regen",
                 "--batch-size", "20")
    assert res.returncode == 0, res.stderr
    log = tmp_path / "worker.log"
    # The README's worker command, word for word (-n as the README gives it).
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "workers", "worker",
                             "-Q", "gpu0", "-n", "gpu0@%h"], env=readme_env, cwd=project,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    worker = WorkerProcess(gpu=0, node=f"gpu0@{socket.gethostname()}", proc=proc,
                           log_path=log, env=readme_env)
    try:
        wait_healthy(r, [worker], timeout_s=90)
        deadline = time.monotonic() + 120
        while True:
            st = orjson.loads(_fleet(readme_env, elsewhere, "status", "--job", "regen",
                                     "--json").stdout)
            if st["done"] and (st["dataset"] or "").startswith("committed"):
                break
            assert time.monotonic() < deadline, f"not done with a data set: {st}"
            time.sleep(0.5)
        assert st["state"] == "done" and st["dataset"] == "committed v1"
        assert st["store"]["url"] == (project / "fleet-data").as_uri()
        assert st["rate_per_sec"] > 0 and st["eta_hours"] == 0.0
        first_read = time.monotonic()
        # Prometheus (the worker's /metrics) and Flower's worker page (inspect stats) agree.
        port = int(readme_env["FLEET_METRICS_BASE_PORT"])
        fams = {f.name: f for f in text_string_to_metric_families(
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)}
        states = {s.labels["state"]: s.value for s in fams["fleet_job_state"].samples
                  if s.labels["job"] == "regen"}
        assert states == {"running": 0, "paused": 0, "cancelled": 0, "done": 1}
        assert fams["fleet_job_dataset_version"].samples[0].value == 1
        res = subprocess.run([sys.executable, "-m", "celery", "-A", "workers", "inspect",
                              "stats", "-j", "-t", "5"], env=readme_env, cwd=project,
                             capture_output=True, text=True, timeout=60)
        (stats,) = orjson.loads(res.stdout).values()
        assert stats["fleet_jobs"]["regen"] == "done 100.0 %, data set committed v1"
        time.sleep(max(0.0, 10 - (time.monotonic() - first_read)))
        later = orjson.loads(_fleet(readme_env, elsewhere, "status", "--job", "regen",
                                    "--json").stdout)
        assert later["elapsed_s"] == st["elapsed_s"]
        assert later["rate_per_sec"] == st["rate_per_sec"]  # the active span's, not decaying
        jobs = {j["job"]: j for j in orjson.loads(
            _fleet(readme_env, elsewhere, "jobs", "--json").stdout)}
        assert jobs["regen"]["state"] == "done" and jobs["regen"]["dataset"] == "committed v1"
        res = _fleet(readme_env, elsewhere, "dataset-path", "--job", "regen")
        assert res.returncode == 0, res.stderr
        data = Path(res.stdout.strip())
        assert data.is_dir() and data.is_relative_to(project / "fleet-data")
        assert list(data.glob("*.parquet"))
        res = _fleet(readme_env, elsewhere, "report", "--job", "regen", "--out",
                     str(tmp_path / "report"), "--json")
        summary = orjson.loads(res.stdout)
        assert (summary["state"], summary["rate_per_sec"]) == ("done", st["rate_per_sec"])
        assert summary["bucket_s"] <= 2  # a job of seconds is drawn in buckets of seconds
        res = _fleet(readme_env, elsewhere, "verify", "--job", "regen", "--json")
        assert res.returncode == 0 and orjson.loads(res.stdout)["unique"] == 60
        # Piped, the table is drawn whole and ends with a newline.
        res = _fleet(readme_env, elsewhere, "status", "--job", "regen")
        assert res.stdout.endswith("\n") and "…" not in res.stdout
        assert "done" in res.stdout and "committed v1" in res.stdout
        # A FLEET_STORE_URL that names another store is refused with one line.
        other = {**readme_env, "FLEET_STORE_URL": (tmp_path / "other").as_uri()}
        res = _fleet(other, elsewhere, "status", "--job", "regen")
        assert res.returncode == 3
        assert res.stderr.count("\n") == 1 and "FLEET_STORE_URL" in res.stderr
    finally:
        worker.stop(grace_s=20)


def test_a_job_that_is_not_there_is_named_so(fleet_env):
    for args in (("export", "--job", "nosuch", "--format", "jsonl", "--out", "/tmp/x.jsonl"),
                 ("dataset-path", "--job", "nosuch")):
        res = run_producer(fleet_env, *args)
        assert res.returncode == 3
        assert "no job 'nosuch'" in res.stderr and "data set" not in res.stderr


def test_diagnose_with_no_worker_says_no_engine_answers(fleet_env):
    res = subprocess.run([sys.executable, "-m", "producer", "tune", "diagnose", "--gpu", "0"],
                         env=fleet_env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "no engine answers on GPU 0" in res.stderr and "is its worker running?" in res.stderr
    assert "no reading for" not in res.stderr


def test_diagnose_without_config_says_so_and_a_snapshot_carries_it(tmp_path):
    snap_dir = tmp_path / "snap"
    shutil.copytree(SNAPSHOTS / "real_h200_big80", snap_dir)
    profile = orjson.loads((snap_dir / "profile.json").read_bytes())
    missing = tmp_path / "weights-not-here"
    profile["flags"]["model-path"] = str(missing)
    (snap_dir / "profile.json").write_bytes(orjson.dumps(profile))
    d = diagnose(snapshot.load(snap_dir)).to_json()
    reasons = " ".join(d["recommendation"]["reasons"])
    assert "cannot plan a relaunch without the model's config.json" in reasons
    assert str(missing / "config.json") in reasons
    assert "no lever fits" not in reasons and d["recommendation"]["flags"] == {}
    # The model's config.json beside the snapshot (as `tune snapshot` now captures it) plans.
    shutil.copy(MODEL / "config.json", snap_dir / "config.json")
    d = diagnose(snapshot.load(snap_dir)).to_json()
    assert d["recommendation"]["flags"].get("max-running-requests", 0) > 16


def test_a_captured_snapshot_carries_the_models_config(tmp_path):
    target = snapshot.Target(0, "http://127.0.0.1:9", tmp_path / "engine.log")
    profile = {"flags": {"model-path": str(MODEL)}}
    snap = snapshot.capture(target, None, profile, None)
    assert snap["model_config"]["config"] == orjson.loads((MODEL / "config.json").read_bytes())
    assert snap["model_config"]["source"] == str(MODEL / "config.json")


def test_status_when_redis_forgot_the_store_falls_back_to_the_settings(fleet_env, r):
    """A job Redis does not know keeps the command's own store (and its one-line error)."""
    r.flushall()
    res = run_producer(fleet_env, "status", "--job", "ghost")
    assert res.returncode == 3 and "no job 'ghost'" in res.stderr
