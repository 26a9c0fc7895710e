"""Issue 45: a newcomer's path, second pass: what status, verify, the report, Flower and a
worker's start say (items 4 to 8, 11 to 13; enqueue's items are in tests/test_newcomer.py)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.main import get_command
from typer.testing import CliRunner

from producer.cli import cli as fleet_cli
from producer.localfleet import free_port, stop_process
from tests.conftest import run_producer, wait_done, write_prompts
from workers.dataset.jobs import decode_rows, result_key
from workers.dataset.store import LocalStore
from workers.redisdb.keys import JobKeys, NodeKeys

ROOT = Path(__file__).resolve().parents[1]


def _commands(cmd: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, [*path, name])
    else:
        yield path, cmd


COMMANDS = list(_commands(get_command(fleet_cli), []))


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help_at_80_columns_names_every_option_whole(path: list[str], cmd: Any) -> None:
    res = CliRunner().invoke(fleet_cli, [*path, "--help"], env={"COLUMNS": "80", "LINES": "24"})
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    missing = [o for p in cmd.params for o in p.opts if o.startswith("--")
               and o not in res.output]
    assert not missing, f"cut at 80 columns: {missing}\n{res.output}"
    assert "…" not in res.output, res.output
    assert "%%" not in res.output, res.output


def test_enqueue_help_quality_example_has_one_percent_sign() -> None:
    res = CliRunner().invoke(fleet_cli, ["enqueue", "--help"], env={"COLUMNS": "200"})
    assert "near_empty=1%," in res.output, res.output


def _status(prompts: int, samples: int, finished: int) -> dict:
    """A status as producer/status.py's job_status shapes it (the keys the views read)."""
    return {"job": "j", "state": "running", "total": samples, "samples": samples,
            "samples_done": finished, "prompts": prompts, "prompts_done": 0,
            "completed": finished, "failed": 0, "quarantined": 0, "truncated": 0,
            "done_batches": 0, "in_flight_batches": 1, "queued_batches": 2, "splits": {},
            "rate_per_sec": 1.0, "tokens_per_sec": 10.0, "eta_hours": 0.1, "done": False,
            "elapsed_s": 5.0, "dataset": None, "quality": {}, "workers": [], "stalled": [],
            "output_tokens": 100, "active_s": 5.0}


def test_samples_are_called_samples_where_samples_are_counted() -> None:
    """Item 4: 150 prompts x 2 samples: the watch line and the tables say samples."""
    from rich.console import Console

    from producer import render, report

    st = _status(150, 300, 58)
    assert "58/300 samples" in render.progress_line(st)
    assert "58/40 prompts" in render.progress_line(_status(40, 40, 58))
    console = Console(width=200, record=True)
    console.print(render.status_table(st))
    text = console.export_text()
    assert "progress (samples)" in text and "58/300" in text
    assert "prompts done (every sample stored)" in text and "0/150" in text
    md = report.markdown({**report.summarize(st, report.Timeline(width=1), report.RowStats()),
                          "quality": None})
    header, _, row = md.splitlines()[2:5]
    assert header.startswith("| prompts | samples | completed") and row.startswith("| 150 | 300 |")


def test_the_docs_count_and_name_the_plots_the_report_writes() -> None:
    """Item 7: observability.md counts the report's PNGs and names each; no doc names a plot
    the report does not write (the docs' own screenshots aside)."""
    import re

    from producer.report import PLOTS

    docs = Path(__file__).parents[1] / "docs"
    words = {6: "six"}
    obs = (docs / "observability.md").read_text()
    assert f"{words[len(PLOTS)]} PNGs" in obs
    assert all(f"`{name}`" in obs for name in PLOTS)
    shots = {p.name for p in docs.glob("*.png")}
    for doc in docs.glob("*.md"):
        named = set(re.findall(r"`([\w-]+\.png)`", doc.read_text()))
        assert named <= set(PLOTS) | shots, (doc.name, named - set(PLOTS) - shots)


def _start_flower(env: dict[str, str], log: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """The documented Flower command, on a free port of 127.0.0.1; (url, process) once it
    answers its health check."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers", "flower", f"--port={port}",
         "--conf=deploy/flowerconfig.py"], env=env, cwd=ROOT, stdout=log.open("wb"),
        stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthcheck", timeout=2).status_code == 200:
                return url, proc
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.3)


def test_flowers_api_answers_as_observability_md_says(fleet_env, tmp_path) -> None:
    """Item 6: without credentials the API answers 401 naming FLOWER_UNAUTHENTICATED_API;
    with it set, or with FLOWER_BASIC_AUTH and the credentials passed, it answers."""
    for extra in ({}, {"FLOWER_UNAUTHENTICATED_API": "true"},
                  {"FLOWER_BASIC_AUTH": "admin:pw-for-the-test"}):
        url, proc = _start_flower({**fleet_env, **extra}, tmp_path / "flower.log")
        try:
            api = f"{url}/api/workers?refresh=0"
            plain = httpx.get(api, timeout=20)
            if not extra:
                assert plain.status_code == 401
                assert "FLOWER_UNAUTHENTICATED_API" in plain.text
            elif "FLOWER_UNAUTHENTICATED_API" in extra:
                assert plain.status_code == 200 and plain.json() == {}
            else:
                assert plain.status_code == 401
                got = httpx.get(api, auth=("admin", "pw-for-the-test"), timeout=20)
                assert got.status_code == 200 and got.json() == {}
        finally:
            stop_process(proc, grace_s=10)


def test_after_the_commit_status_names_the_failed_gate_and_verify_shows_its_verdict(
        fleet_env, make_workers, tmp_path, r) -> None:
    """Item 8: near-empty answers: once the data set is committed, ``status`` names the gate
    in its table and labels the stderr line as the committed verdict; ``verify``'s table ends
    with ``FAILED: quality gate near_empty (exit 5)`` and never shows ``ok yes``."""
    env = {**fleet_env, "FLEET_QUALITY": ""}  # the default gates
    make_workers([0], FLEET_SIM_ANSWER="near-empty", FLEET_QUALITY="")
    prompts = write_prompts(tmp_path / "p.jsonl", 300)
    assert run_producer(env, "enqueue", str(prompts), "--job", "gate", "--batch-size",
                        "100").returncode == 0
    wait_done(env, "gate")
    from producer.demo import _wait_dataset  # the data set is committed after the job is done

    assert (_wait_dataset(r, "gate", 120) or "").startswith("committed")
    res = run_producer({**env, "COLUMNS": "200"}, "status", "--job", "gate")
    assert "committed data set: 1 gate failed: near_empty" in res.stdout, res.stdout
    assert "done, quality: 1 gate failed: near_empty" in res.stdout
    assert "quality of the committed data set: 1 gate(s) failed: near_empty" in res.stderr
    assert "quality warning" not in res.stderr, res.stderr
    res = run_producer({**env, "COLUMNS": "200"}, "verify", "--job", "gate")
    assert res.returncode == 5
    assert "FAILED: quality gate near_empty (exit 5)" in res.stdout, res.stdout
    assert "every prompt once" in res.stdout and "quality: 1 gate failed: near_empty" in res.stdout
    assert not any(line.split("│")[1:2] == [" ok "] for line in res.stdout.splitlines())


def test_a_queue_naming_a_gpu_the_node_lacks_is_refused_by_name(fleet_env, r) -> None:
    """Item 11: the simulator's node has FLEET_SIM_GPUS GPUs (8): ``-Q gpu99`` and a group
    reaching past the last GPU are refused with one line, as ``-Q gpux`` is."""
    from tests.test_gpu_groups import _refusal

    line = _refusal(fleet_env, "gpu99")
    assert "queue gpu99 names GPU 99, but this node has GPUs 0-7 (FLEET_SIM_GPUS)" in line
    line = _refusal({**fleet_env, "FLEET_SIM_GPUS": "2"}, "gpu1-2")
    assert "queue gpu1-2 names GPU 2, but this node has GPUs 0-1" in line
    assert not r.keys("fleet:worker:*")  # nothing ever ran


def test_nvml_numbering_bounds_a_real_nodes_queues() -> None:
    """Item 11, the real node's rule: NVML's count, in the container's own numbering."""
    from workers.node.gpu_group import GroupError, check_present, parse_group

    check_present(parse_group("gpu6-7"), "gpu6-7", 8, "NVML")
    with pytest.raises(GroupError, match="names GPU 8, but this node has GPUs 0-7 \\(NVML\\)"):
        check_present(parse_group("gpu8"), "gpu8", 8, "NVML")
    check_present(parse_group("gpu2-3"), "gpu2-3", 2, "NVML", [0, 1])  # FLEET_CUDA_DEVICE=0,1
    with pytest.raises(GroupError, match="this node has no GPU"):
        check_present(parse_group("gpu0"), "gpu0", 0, "NVML")


def test_verify_the_manifest_and_the_report_agree_on_max_completion_tokens(tmp_path, r):
    """Item 12: the largest answer has 8,174 tokens: verify (row by row), the sink's
    manifest (column by column) and the report all say 8,174 (verify said the histogram
    bucket's floor, 8,104; the report printed 8174.0)."""
    from producer.report import build_report
    from tests.test_sink import make_job, prompt_rows
    from workers.dataset.jobs import encode_rows
    from workers.dataset.manifest import load_manifest
    from workers.dataset.sink import ShardLimits, aggregate
    from workers.dataset.verify import verify_job
    from workers.delivery import jobstate

    store = LocalStore(tmp_path / "store")
    spec = make_job(store, "mx", prompt_rows(20), batch_size=10)
    for b in range(2):
        rows = decode_rows(store.get(result_key("mx", b)))
        for x in rows:
            if x["status"] == "ok":
                x["completion_tokens"] = 8174 if x["index"] == 12 else 300 + 37 * x["index"]
        store.put(result_key("mx", b), encode_rows(rows, compress=False))
    assert verify_job(store, spec)["quality"]["completion_tokens"]["max"] == 8174
    aggregate(store, "mx", ShardLimits())
    assert load_manifest(store, "mx")["quality"]["completion_tokens"]["max"] == 8174
    jobstate.register_job(r, "mx", spec.model_dump_json())
    summary = build_report(r, store, spec, tmp_path / "rep")
    assert summary["output_length_tokens"]["max"] == 8174
    line = next(x for x in (tmp_path / "rep" / "report.md").read_text().splitlines()
                if x.startswith("| output length"))
    assert line.endswith("| 8,174 |") and "8174.0" not in line, line


def test_an_idle_engine_shows_no_tokens_per_sec_and_its_current_load(r, tmp_path) -> None:
    """Item 13: a worker whose engine runs and queues nothing reports 0 tok/s, though its
    token counter rose within the rate window (a worker that cannot read its engine keeps
    the window's rate), and each engine reading carries its time."""
    from tests.simproc import launch
    from workers.observe.gauges import WorkerWatch

    sim = launch(tmp_path, ["--model-path", "Qwen/Qwen3-0.6B", "--context-length", "4096",
                            "--enable-metrics"])
    try:
        sim.wait_ready()
        idle = WorkerWatch(sim.url, r, "gpu0@idle", 1.0, 60.0)
        blind = WorkerWatch(f"http://127.0.0.1:{free_port()}", r, "gpu0@idle", 1.0, 60.0)
        for watch in (idle, blind):
            watch.tick()
        r.hset(NodeKeys("gpu0@idle").stats, "output_tokens", 5000)
        time.sleep(0.2)
        for watch in (idle, blind):
            watch.tick()
        assert (idle.engine.running, idle.engine.queued) == (0, 0)
        assert idle.tokens_per_sec == 0.0 and blind.tokens_per_sec > 0
        fields = idle.engine_fields()
        assert time.time() - 5 < fields["engine_read_at"] <= time.time()
    finally:
        sim.stop()


def test_after_the_end_a_beat_whose_engine_reading_is_older_shows_no_load(r) -> None:
    """Item 13: a heartbeat sent after the job's end may carry an engine reading taken
    before it (the watch reads once an interval): its load and tok/s are unknown, not the
    end's ``39/40 running, queue 1`` and tok/s."""
    from rich.console import Console

    from producer import render
    from producer.status import job_status
    from workers.dataset.jobs import JobSpec
    from workers.delivery import jobstate
    from workers.node import heartbeat

    spec = JobSpec(name="end", total=4, batch_size=4, n_batches=1, input_path="x",
                   input_fingerprint="f")
    jobstate.register_job(r, "end", spec.model_dump_json())
    end = time.time()
    r.hset(JobKeys("end").job, mapping={"last_row_at": end, "first_taken_at": end - 5})
    r.sadd(JobKeys("end").done, 0)
    r.hset(JobKeys("end").stats, mapping={"completed": 4})
    beat = {"node": "gpu0@t", "gpu": 0, "engine": "sim", "profile": "p",
            "engine_state": "healthy", "engine_restarts": 0, "batches_running": 1,
            "tokens_per_sec": 170.0, "output_tokens": 40, "running": 39, "cap": 40, "queued": 1,
            "updated_at": end + 2, "engine_read_at": end - 1}
    heartbeat.publish(r, "gpu0@t", beat, 30)
    st = job_status(r, spec)
    w = st["workers"][0]
    assert w["stale"] and (w["running"], w["queued"], w["tokens_per_sec"]) == (None,) * 3
    console = Console(record=True, width=160)
    console.print(render.status_table(st))
    text = console.export_text()
    assert "39/40" not in text and "170" not in text, text
    heartbeat.publish(r, "gpu0@t", {**beat, "running": 0, "queued": 0, "tokens_per_sec": 0.0,
                                    "engine_read_at": end + 1.5}, 30)
    w = job_status(r, spec)["workers"][0]
    assert not w.get("stale") and (w["running"], w["queued"], w["tokens_per_sec"]) == (0, 0, 0)


def test_real_sglang_loads_are_current_where_its_gauges_lag() -> None:
    """Item 13, why running and queued come from /v1/loads: on a real H200 (SGLang 0.5.11,
    load_samples.jsonl, one reading a second) /v1/loads said 16 running 1.4 s into the load
    while the num_running_reqs gauge still said 1 (it is written at decode-log steps)."""
    from tests.realfixtures import samples

    rows = samples("big80")
    lagging = [x for x in rows
               if x["num_running_reqs"] != float(x["metrics"]["sglang:num_running_reqs"])]
    assert lagging and lagging[1]["t"] > 1 and lagging[1]["num_running_reqs"] == 16
    assert float(lagging[1]["metrics"]["sglang:num_running_reqs"]) == 1.0
