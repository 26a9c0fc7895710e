"""The fleet seen from outside: Flower in headless Chromium, status vs verify, Prometheus, report.

One fleet run (two simulated GPU workers, Flower behind basic auth, one job) serves every check,
so the suite starts workers once. Chromium is Debian's ``chromium`` driven by the Python
``playwright`` package (``make test`` installs both; ``playwright install`` is never used).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
from playwright.sync_api import Page, sync_playwright
from prometheus_client.parser import text_string_to_metric_families

from producer.localfleet import free_port, free_port_block, stop_process
from tests.conftest import ROOT, run_producer, wait_done, write_prompts

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
JOB = "seen"


@dataclass
class Flower:
    """A ``celery -A workers flower`` process with the shipped config."""

    url: str
    auth: tuple[str, str]
    proc: subprocess.Popen[bytes]
    log: Path

    def wait_ready(self, timeout_s: float = 60) -> None:
        """Wait until Flower answers its health check."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/healthcheck", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"Flower did not answer within {timeout_s} s"
            time.sleep(0.3)


@pytest.fixture()
def flower(fleet_env: dict[str, str], tmp_path: Path) -> Iterator[Flower]:
    """Flower starting on a free port of 127.0.0.1, basic auth from FLOWER_BASIC_AUTH."""
    port, auth, log = free_port(), ("fleet", secrets.token_urlsafe(12)), tmp_path / "flower.log"
    env = {**fleet_env, "FLOWER_BASIC_AUTH": ":".join(auth)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers", "flower", "--address=127.0.0.1",
         f"--port={port}", "--conf=deploy/flowerconfig.py", "--inspect_timeout=5000"],
        env=env, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    yield Flower(f"http://127.0.0.1:{port}", auth, proc, log)
    stop_process(proc, grace_s=10)


def _stored_tokens(store_url: str) -> int:
    store = Path(store_url.removeprefix("file://"))
    return sum(orjson.loads(line)["completion_tokens"]
               for f in (store / f"jobs/{JOB}/results").glob("*.jsonl")
               for line in f.read_bytes().splitlines())


def _exported_tokens(metrics_base: int) -> float:
    total = 0.0
    for gpu in (0, 1):
        text = httpx.get(f"http://127.0.0.1:{metrics_base + gpu}/metrics", timeout=10).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        (sample,) = fams["fleet_output_tokens"].samples
        assert sample.labels["gpu"] == str(gpu)
        total += sample.value
    return total


def _worker_field(page: Page, url: str, node: str, name: str) -> float:
    """A ``fleet_*`` row of a worker's page (tab Other, from inspect stats)."""
    deadline = time.monotonic() + 60
    while True:  # the page 404s while the worker's first inspect reply is outstanding
        if page.goto(f"{url}/worker/{node}").status == 200:
            break
        assert time.monotonic() < deadline, f"no worker page for {node}"
        time.sleep(1)
    page.click("#worker-tab-other")
    row = page.locator("#tab-other tr", has_text=name)
    return float(row.locator("td").nth(1).inner_text().replace(",", ""))


def _check_flower(flower: Flower, out: Path, nodes: list[str]) -> None:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(http_credentials={"username": flower.auth[0],
                                                        "password": flower.auth[1]},
                                      viewport={"width": 1400, "height": 900})
        page = context.new_page()
        page.goto(f"{flower.url}/workers")
        for node in nodes:
            page.locator("#workers-table tbody tr", has_text=node).wait_for(timeout=30_000)
        page.screenshot(path=out / "flower-workers.png", full_page=True)
        for node in nodes:  # the job is over: tokens made, none being made (issue 45)
            assert _worker_field(page, flower.url, node, "fleet_output_tokens") > 0, node
            assert _worker_field(page, flower.url, node, "fleet_tokens_per_sec") == 0, node
        page.screenshot(path=out / "flower-worker.png", full_page=True)  # the last one
        page.goto(f"{flower.url}/tasks")
        done = page.locator("#tasks-table tbody tr", has_text="SUCCESS")
        done.first.wait_for(timeout=30_000)
        texts = done.all_inner_texts()
        batches = [t for t in texts if "fleet.run_batch" in t]
        assert batches and all(re.search(r"\d+ prompts, [\d,]+ tokens, [\d,]+ tok/s", t)
                               for t in batches), texts
        # The data set the GPU workers built when the job ended (they consume the sink queue).
        sinks = [t for t in texts if "fleet.sink_job" in t]
        assert all(re.search(r"data set v\d{6}-\w+: [\d,]+ rows in \d+ shards, complete", t)
                   for t in sinks), sinks
        page.screenshot(path=out / "flower-tasks.png", full_page=True)
        browser.close()


def _fresh_status(fleet_env: dict[str, str], timeout_s: float = 15) -> dict:
    """``status --json`` of the done job once every worker sent a heartbeat after its end."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = orjson.loads(run_producer(fleet_env, "status", "--job", JOB, "--json").stdout)
        if not any(w.get("stale") for w in st["workers"]):
            return st
        assert time.monotonic() < deadline, f"no heartbeat after the end: {st['workers']}"
        time.sleep(0.5)


def test_flower_status_prometheus_and_report_show_the_run(fleet_env, make_workers, flower,
                                                          tmp_path, r):
    metrics_base = free_port_block(8)
    workers = make_workers([0, 1], FLEET_METRICS_BASE_PORT=str(metrics_base),
                           FLEET_RATE_WINDOW_S="600", FLEET_PROGRESS_EVENT_INTERVAL_S="0.5")
    flower.wait_ready()  # started with the workers; it must see the job's task events
    assert httpx.get(f"{flower.url}/workers", timeout=10).status_code == 401  # auth is on
    prompts = write_prompts(tmp_path / "prompts.jsonl", 160)
    res = run_producer(fleet_env, "enqueue", str(prompts), "--job", JOB, "--batch-size", "20",
                       "--max-new-tokens", "200")
    assert res.returncode == 0, res.stderr
    wait_done(fleet_env, JOB)

    # status --json agrees with verify (which counts from the store alone).
    st = orjson.loads(run_producer(fleet_env, "status", "--job", JOB, "--json").stdout)
    report = orjson.loads(run_producer(fleet_env, "verify", "--job", JOB, "--json").stdout)
    assert report["ok"], report
    assert (st["completed"] + st["failed"], st["failed"], st["truncated"], st["total"]) == (
        report["rows"], report["failed"], report["truncated"], report["expected"])
    assert {w["node"] for w in st["workers"]} == {w.node for w in workers}
    # A done job's table shows no load from before the end: a heartbeat sent before the last
    # row has its load columns unknown; the first beats after it show the idle fleet.
    for w in st["workers"]:
        assert w["cap"] == 40, st["workers"]
        if w.get("stale"):
            assert (w["running"], w["queued"], w["batches_running"]) == (None,) * 3, w
        else:
            assert w["running"] is not None, w
    fresh = _fresh_status(fleet_env)
    assert all(w["cap"] == 40 and (w["running"], w["queued"]) == (0, 0)
               for w in fresh["workers"]), fresh["workers"]

    # Each worker's exporter: the token counters add up to the job's output tokens.
    tokens = _stored_tokens(fleet_env["FLEET_STORE_URL"])
    assert tokens == st["output_tokens"] > 0
    assert _exported_tokens(metrics_base) == tokens

    out = tmp_path / "report"
    res = run_producer(fleet_env, "report", "--job", JOB, "--out", str(out))
    assert res.returncode == 0, res.stderr
    for name in ("throughput", "progress", "latency", "output_length", "finish_reasons"):
        assert (out / f"{name}.png").stat().st_size > 5000, name

    _check_flower(flower, tmp_path, [w.node for w in workers])
    if os.environ.get("FLEET_UPDATE_DOCS") == "1":  # refresh the screenshots of docs/
        docs = ROOT / "docs"
        shutil.copyfile(tmp_path / "flower-tasks.png", docs / "flower.png")
        shutil.copyfile(tmp_path / "flower-worker.png", docs / "flower-worker.png")
