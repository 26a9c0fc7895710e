"""Observability parts on real Redis, real HTTP and real Celery events (no GPU workers).

The end-to-end run (two workers, Flower in Chromium, status vs verify, the Prometheus token
counter, the report) is tests/test_flower_browser.py.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from celery.events.state import State
from celery.utils.saferepr import saferepr
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from tornado.options import options

from config.settings import Settings
from producer import render
from producer.localfleet import RedisServer, free_port
from producer.report import PLOTS, build_report
from workers.dataset.jobs import JobSpec, encode_rows, result_key, save_spec
from workers.dataset.store import open_store
from workers.delivery import jobstate
from workers.delivery.progress import BatchEnv, ProgressRecorder
from workers.engine.lifecycle import EngineState
from workers.node.context import WorkerIdentity
from workers.observe.events import BATCH_TASK, TaskProgress, format_task, worker_info
from workers.observe.gauges import KEEP_LAST_S, EngineSample, RateWindow, WorkerWatch, sample_from
from workers.observe.metrics import Exporter, FleetCollector, record_batch
from workers.redisdb.keys import JobKeys, NodeKeys
from workers.sim.report import SimMetrics
from workers.wiring.celery_app import make_app

ROOT = Path(__file__).resolve().parents[1]
NODE = "gpu3@obs"


def _row(index: int, kind: str, tokens: int = 10) -> dict[str, Any]:
    """A stored result row of the given kind (as workers/delivery/progress.py builds them)."""
    ok = kind in ("ok", "truncated")
    return {"job": "obs", "batch": 0, "index": index, "id": f"p{index}",
            "prompt": None if kind == "quarantined" else f"q{index}", "messages": None,
            "completion": "x" if ok else None, "reasoning": None,
            "finish_reason": {"ok": "stop", "truncated": "length"}.get(kind),
            "prompt_tokens": 5 if ok else 0, "completion_tokens": tokens if ok else 0,
            "latency_s": 0.1 * (index + 1) if ok else None, "status": "ok" if ok else "failed",
            "error": None if ok else "no 'prompt' or 'messages'" if kind == "quarantined"
            else "gave up", "profile": "p", "gpu": 3, "node": NODE}


class _Engine:
    state = EngineState.HEALTHY
    restarts = 2


class _Watch:
    engine = EngineSample(running=12, queued=3, cap=40, kv_usage=0.5, mamba_usage=0.25,
                          accept_length=2.5, gen_throughput=900.0)
    tokens_per_sec = 123.0


def test_rate_window_measures_recent_rate_and_forgets_idle_time():
    rate = RateWindow(window_s=10)
    for t in range(6):
        rate.add(float(t), 100 * t)
    assert rate.rate() == pytest.approx(100.0)
    for t in range(6, 30):  # idle: the counter stands still for longer than the window
        rate.add(float(t), 500)
    assert rate.rate() == 0.0
    rate.add(30.0, 40)  # a reset counter (Redis lost it) starts over instead of going negative
    assert rate.rate() == 0.0


def test_engine_sample_reads_sglang_metrics_and_effective_cap():
    sim = SimMetrics("qwen")
    sim.set(num_running_reqs=12, num_queue_reqs=3, token_usage=0.5, full_token_usage=0.4,
            mamba_usage=0.25, spec_accept_length=2.6, gen_throughput=850.0)
    loads = {"loads": [{"num_running_reqs": 11, "num_waiting_reqs": 4, "token_usage": 0.45,
                        "max_running_requests": 40, "gen_throughput": 800.0}]}
    sample = sample_from(sim.render().decode(), loads)
    # Running and queued from /v1/loads, read live; the gauges may be 30 s old (issue 45).
    assert sample == EngineSample(running=11, queued=4, cap=40, kv_usage=0.4, mamba_usage=0.25,
                                  accept_length=pytest.approx(2.6), gen_throughput=850.0)
    # Without --enable-metrics the engine's /v1/loads still gives running, queue and cap.
    only_loads = sample_from(None, loads)
    assert (only_loads.running, only_loads.queued, only_loads.cap) == (11, 4, 40)
    assert sample_from(None, None) is None


def test_a_failed_scrape_keeps_the_last_full_sample_for_a_while(r: redis.Redis):
    watch = WorkerWatch(f"http://127.0.0.1:{free_port()}", r, NODE, 1.0, 60.0)  # refuses
    full = EngineSample(running=12, queued=3, cap=40, kv_usage=0.5)
    watch.engine = full
    watch._full_at = time.monotonic()
    watch.tick()
    assert watch.engine == full  # one slow or failed scrape does not blank the gauges
    watch._full_at = time.monotonic() - KEEP_LAST_S - 1
    watch.tick()
    assert watch.engine is None  # an engine silent for longer is unknown


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_exporter_serves_counters_from_redis_and_engine_gauges(r: redis.Redis,
                                                               redis_server: RedisServer):
    r.hset(NodeKeys(NODE).stats, mapping={"output_tokens": 4321, "rows": 7})
    r.hset(NodeKeys(NODE).prompts, mapping={"ok": 5, "failed": 1, "quarantined": 1})

    async def batches() -> None:
        client = aioredis.from_url(redis_server.url)
        for secs in (3.0, 40.0, 50.0):
            await record_batch(client, NODE, secs)
        await client.aclose()

    asyncio.run(batches())
    port = free_port()
    exporter = Exporter(FleetCollector(r, NODE, 3, _Watch(), _Engine()), "127.0.0.1", port)
    assert exporter.start()
    try:
        assert not Exporter(exporter.registry, "127.0.0.1", port).start()  # port taken: no crash
        fams = _families(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    finally:
        exporter.stop()
    labels = {"gpu": "3", "node": NODE}
    (tokens,) = fams["fleet_output_tokens"].samples
    assert (tokens.name, tokens.labels, tokens.value) == ("fleet_output_tokens_total", labels,
                                                          4321)
    prompts = {s.labels["status"]: s.value for s in fams["fleet_prompts"].samples}
    assert prompts == {"ok": 5, "truncated": 0, "failed": 1, "quarantined": 1}
    hist = {s.name: s for s in fams["fleet_batch_seconds"].samples if "le" not in s.labels}
    assert hist["fleet_batch_seconds_count"].value == 3
    assert hist["fleet_batch_seconds_sum"].value == pytest.approx(93.0)
    le60 = [s for s in fams["fleet_batch_seconds"].samples if s.labels.get("le") == "60"]
    assert le60[0].value == 3
    gauges = {name: fams[name].samples[0].value for name in (
        "fleet_engine_running_requests", "fleet_engine_queued_requests",
        "fleet_engine_running_cap", "fleet_engine_kv_usage", "fleet_engine_mamba_usage",
        "fleet_engine_spec_accept_length", "fleet_worker_output_tokens_per_second")}
    assert gauges == {"fleet_engine_running_requests": 12, "fleet_engine_queued_requests": 3,
                      "fleet_engine_running_cap": 40, "fleet_engine_kv_usage": 0.5,
                      "fleet_engine_mamba_usage": 0.25, "fleet_engine_spec_accept_length": 2.5,
                      "fleet_worker_output_tokens_per_second": 123}
    states = {s.labels["state"]: s.value for s in fams["fleet_engine_state"].samples}
    assert states["healthy"] == 1 and sum(states.values()) == 1
    assert fams["fleet_engine_restarts"].samples[0].value == 2
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)


def _env(url: str, tmp_path: Path, hook: Any = None) -> BatchEnv:
    settings = Settings(store_url=tmp_path.as_uri())
    me = WorkerIdentity(node=NODE, host="obs", gpu=3, port=1)
    return BatchEnv(settings=settings, me=me, store=open_store(tmp_path.as_uri()),
                    redis=aioredis.from_url(url), profile="p", on_progress=hook)


def test_progress_recorder_counts_each_kind_once_and_reports_progress(r, redis_server, tmp_path):
    seen: list[tuple[int, int]] = []

    async def hook(rows: int, tokens: int) -> None:
        seen.append((rows, tokens))

    async def record() -> None:
        env = _env(redis_server.url, tmp_path, hook)
        r.set(JobKeys("obs").owner(0), "n|1|2|tok")  # the recorder's run owns the batch
        rec = ProgressRecorder(env, "obs", 0, "n|1|2|tok")
        for i, kind in enumerate(("ok", "ok", "truncated", "failed", "quarantined")):
            rec.add(_row(i, kind))
        await rec.flush()
        rec.add(_row(0, "ok"))  # a redelivered row is not counted again
        await rec.flush()
        await env.redis.aclose()

    asyncio.run(record())
    kinds = {k.decode(): int(v) for k, v in r.hgetall(NodeKeys(NODE).prompts).items()}
    assert kinds == {"ok": 2, "truncated": 1, "failed": 1, "quarantined": 1}
    c = jobstate.counters(r, "obs")
    assert (c["completed"], c["failed"], c["truncated"], c["output_tokens"]) == (3, 1, 1, 30)
    assert int(r.hget(JobKeys("obs").stats, "quarantined")) == 1
    assert seen == [(5, 30), (1, 10)]


def _flower_task(events: list[dict[str, Any]]) -> Any:
    state, now = State(), time.time()
    for clock, event in enumerate(events):
        state.event({"uuid": "t1", "hostname": NODE, "timestamp": now, "local_received": now,
                     "clock": clock, **event})
    return state.tasks["t1"]


def test_format_task_shows_tokens_while_running_and_when_finished():
    progress = TaskProgress(make_app(), "t1", NODE, total=25, gpu=3, interval_s=2.0)
    progress.done, progress.tokens = 12, 3400
    received = {"type": "task-received", "name": BATCH_TASK, "args": "['obs', 0]"}
    running = _flower_task([received, {"type": "task-started"},
                            {"type": "task-progress", "result": repr(progress.fields())}])
    assert running.state == "PROGRESS"
    # Flower formats a copy, which keeps only the standard fields: the numbers ride in result.
    shown = format_task(copy.copy(running)).result
    assert shown.startswith("12/25 prompts, 3,400 tokens,") and "tok/s" in shown
    summary = {"job": "obs", "batch": 0, "rows": 25, "sent": 25, "failed": 1,
               "output_tokens": 6000, "seconds": 4.0}
    done = _flower_task([received, {"type": "task-started"},
                         {"type": "task-progress", "result": repr(progress.fields())},
                         {"type": "task-succeeded", "result": saferepr(summary),
                          "runtime": 4.0}])
    assert format_task(copy.copy(done)).result == (
        "25 prompts, 6,000 tokens, 1,500 tok/s, 4.0 s, 1 failed")
    other = _flower_task([{**received, "name": "celery.ping"},
                          {"type": "task-succeeded", "result": "'pong'"}])
    assert format_task(copy.copy(other)).result == "'pong'"


def test_progress_events_reach_an_event_receiver(redis_server: RedisServer, r):
    app = make_app(Settings(redis_url=redis_server.url))
    got: list[dict[str, Any]] = []

    def on_progress(event: dict[str, Any]) -> None:
        got.append(event)
        receiver.should_stop = True

    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"task-progress": on_progress})
        listen = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=20),
                                  daemon=True)
        listen.start()
        progress = TaskProgress(app, "t9", NODE, total=10, gpu=3, interval_s=0.0)
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:  # PUB/SUB: resend until subscribed
            asyncio.run(progress(1, 7))
            time.sleep(0.1)
        listen.join(timeout=5)
    assert got, "no task-progress event received"
    assert got[0]["uuid"] == "t9" and got[0]["hostname"] == NODE
    assert "'prompts_total': 10" in got[0]["result"]


def test_worker_info_and_status_table_show_running_cap_queue_and_rate():
    beat = {"node": NODE, "gpu": 3, "engine": "sim", "profile": "p", "engine_state": "healthy",
            "engine_restarts": 0, "batches_running": 2, "tokens_per_sec": 851.4,
            "output_tokens": 12345, "running": 12, "cap": 40, "queued": 3, "kv_usage": 0.5}
    info = worker_info(beat)
    assert (info["fleet_running_cap"], info["fleet_queued"], info["fleet_tokens_per_sec"],
            info["fleet_engine_state"]) == ("12/40", "3", 851.4, "healthy")
    assert worker_info({**beat, "running": None, "cap": None})["fleet_running_cap"] == "?/?"
    st = {"job": "j", "state": "running", "total": 10, "completed": 6, "failed": 2,
          "quarantined": 1, "truncated": 1,
          "done_batches": 1, "in_flight_batches": 1, "queued_batches": 0, "rate_per_sec": 1.0,
          "tokens_per_sec": 850.0, "eta_hours": 0.001, "elapsed_s": 8, "done": False,
          "workers": [beat]}
    console = Console(record=True, width=160)
    console.print(render.status_table(st))
    text = console.export_text()
    assert "12/40" in text and "851" in text and "6 / 2 / 1 / 1" in text


@pytest.fixture()
def flower_options() -> Iterator[Any]:
    """Flower's option registry, restored after the test."""
    import flower.options  # noqa: F401  (defines Flower's options on tornado's registry)

    names = ("address", "basic_auth", "auth", "unix_socket", "format_task", "max_tasks",
             "tasks_columns")
    saved = {name: getattr(options, name) for name in names}
    yield options
    for name, value in saved.items():
        setattr(options, name, value)


def test_flower_config_binds_loopback_and_refuses_public_address_without_auth(flower_options):
    conf = str(ROOT / "deploy" / "flowerconfig.py")
    flower_options.address = ""
    flower_options.parse_config_file(conf, final=False)
    assert flower_options.address == "127.0.0.1"
    assert flower_options.format_task is format_task
    flower_options.address = "0.0.0.0"
    with pytest.raises(SystemExit, match="FLOWER_BASIC_AUTH"):
        flower_options.parse_config_file(conf, final=False)
    flower_options.basic_auth = ["admin:s3cret"]
    flower_options.parse_config_file(conf, final=False)
    assert flower_options.address == "0.0.0.0"


def test_report_writes_markdown_summary_and_non_empty_pngs(r, redis_server, tmp_path):
    store = open_store((tmp_path / "store").as_uri())
    spec = JobSpec(name="obs", total=6, batch_size=6, n_batches=1, input_path="x",
                   input_fingerprint="f")
    save_spec(store, spec)
    jobstate.register_job(r, "obs", spec.model_dump_json())
    rows = [_row(i, k, tokens=10 * (i + 1)) for i, k in
            enumerate(("ok", "ok", "ok", "truncated", "failed", "quarantined"))]

    async def record() -> None:
        env = _env(redis_server.url, tmp_path)
        r.set(JobKeys("obs").owner(0), "n|1|2|tok")
        rec = ProgressRecorder(env, "obs", 0, "n|1|2|tok")
        for row in rows:
            rec.add(row)
        await rec.flush()
        await env.redis.aclose()

    asyncio.run(record())
    store.put(result_key("obs", 0), encode_rows(rows, compress=False))
    r.sadd(JobKeys("obs").done, 0)
    out = tmp_path / "report"
    summary = build_report(r, store, spec, out)
    # Exactly the plots docs/observability.md counts (tests/test_newcomer.py checks the docs).
    assert sorted(p.name for p in out.glob("*.png")) == sorted(PLOTS)
    for name in PLOTS:
        png = out / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name
    assert summary["done"] and summary["output_tokens"] == 100
    assert summary["finish_reasons"] == {"stop": 3, "length": 1, "failed": 1, "quarantined": 1}
    assert summary["gpus"] == [{"node": NODE, "prompts": 6, "output_tokens": 100,
                                "busy_tokens_per_sec": 10.0}]
    assert summary["output_length_tokens"]["max"] == 40
    md = (out / "report.md").read_text()
    assert "![tokens/s per GPU](throughput.png)" in md and "| stop | 3 |" in md


def test_the_status_of_a_done_job_shows_no_batches_running_nor_a_queue(r: redis.Redis):
    """A heartbeat sent before the job's last row still carries the end's load (40/40
    running, queue 9): once the job is done, those columns are unknown, not shown."""
    import time as _time

    from producer.status import job_status
    from workers.dataset.jobs import JobSpec
    from workers.delivery import jobstate
    from workers.node import heartbeat

    spec = JobSpec(name="fin", total=4, batch_size=4, n_batches=1, input_path="x",
                   input_fingerprint="f")
    jobstate.register_job(r, "fin", spec.model_dump_json())
    end = _time.time()
    r.hset(JobKeys("fin").job, mapping={"last_row_at": end, "first_taken_at": end - 5})
    r.sadd(JobKeys("fin").done, 0)
    r.hset(JobKeys("fin").stats, mapping={"completed": 4})
    beat = {"node": NODE, "gpu": 0, "engine": "sim", "profile": "p", "engine_state": "healthy",
            "engine_restarts": 0, "batches_running": 1, "tokens_per_sec": 10.0,
            "output_tokens": 40, "running": 40, "cap": 40, "queued": 9, "updated_at": end - 1}
    heartbeat.publish(r, NODE, beat, 30)
    st = job_status(r, spec)
    assert st["done"] and st["workers"][0]["running"] is None, st["workers"]
    console = Console(record=True, width=160)
    console.print(render.status_table(st))
    text = console.export_text()
    assert "40/40" not in text and " 9 " not in text, text
    heartbeat.publish(r, NODE, {**beat, "running": 0, "queued": 0, "batches_running": 0,
                                "updated_at": end + 1}, 30)
    fresh = render._settled(lambda: job_status(r, spec), st, wait_s=5)
    assert (fresh["workers"][0]["running"], fresh["workers"][0]["queued"]) == (0, 0)
