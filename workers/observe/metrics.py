"""Prometheus metrics of a GPU worker, served by its main process on 127.0.0.1:(base + GPU).

Labels: ``gpu`` is the worker's GPU group as ``status`` and Flower show it (``3``, or ``0-1``
for a worker that owns GPUs 0 and 1; the exporter's port is base + the group's first GPU) and
``node`` its Celery node name. ``fleet_worker_gpus`` says how many GPUs the worker owns, so a
dashboard can divide a group's tokens/s by it.

Decision: **the main process alone exports, and Redis is the channel from the pool children.**
Batches run in prefork children, which live and die with their batches, so in-process counters
there would need ``PROMETHEUS_MULTIPROC_DIR`` (chosen before ``prometheus_client`` is first
imported, one directory per worker, cleaned at start, a gauge mode per gauge). Instead every
number comes from a place that already exists or is cheap to keep:

- tokens and prompts: the Redis counters the batch writes with each finished row, counted once
  per row however often a batch is redelivered (``scripts.record_rows``), so they match the job
  exactly and survive a worker restart;
- batch durations: a histogram kept in a Redis hash, bumped by the task when a batch finishes;
- engine gauges, engine state and restarts: the main process's own :class:`WorkerWatch` cache
  and :class:`~workers.engine.lifecycle.Engine`.

The collector reads them at scrape time, from the worker's hashes (workers/redisdb/keys.py):
its lifetime counters (output_tokens, rows), its prompts by kind (ok, truncated, failed,
quarantined -> rows) and its batch seconds (<upper bound> -> batches, sum -> seconds).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from typing import Protocol
from wsgiref.simple_server import WSGIServer

import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from workers.delivery import job_progress
from workers.engine.lifecycle import EngineState
from workers.observe.gauges import EngineSample
from workers.redisdb.keys import NodeKeys

log = logging.getLogger(__name__)

PROMPT_KINDS = ("ok", "truncated", "failed", "quarantined")
# A batch of 500 prompts takes minutes to hours on a real GPU, seconds on the simulator.
BATCH_BUCKETS_S = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, math.inf)
ENGINE_GAUGES = {
    "running": ("fleet_engine_running_requests", "Requests the engine is running."),
    "queued": ("fleet_engine_queued_requests", "Requests waiting in the engine's queue."),
    "cap": ("fleet_engine_running_cap", "The engine's effective running-request cap."),
    "kv_usage": ("fleet_engine_kv_usage", "KV-cache token usage (0-1)."),
    "mamba_usage": ("fleet_engine_mamba_usage", "Mamba state pool usage (0-1)."),
    "accept_length": ("fleet_engine_spec_accept_length", "Speculative decoding accept length."),
    "gen_throughput": ("fleet_engine_gen_throughput", "Engine-reported generation tokens/s."),
}
LABELS = ["gpu", "node"]


class EngineView(Protocol):
    """What the collector reads of the engine (:class:`workers.engine.lifecycle.Engine`)."""

    state: EngineState
    restarts: int


class WatchView(Protocol):
    """What the collector reads of the cache (:class:`workers.observe.gauges.WorkerWatch`)."""

    engine: EngineSample | None
    tokens_per_sec: float


def _bound(le: float) -> str:
    return "+Inf" if math.isinf(le) else str(le)


async def record_batch(r: aioredis.Redis, node: str, seconds: float) -> None:
    """Count one finished batch of ``seconds`` in the worker's histogram (best effort)."""
    le = next(b for b in BATCH_BUCKETS_S if seconds <= b)
    key = NodeKeys(node).batch_seconds
    try:
        async with r.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, _bound(le), 1)
            pipe.hincrbyfloat(key, "sum", seconds)
            await pipe.execute()
    except redis.RedisError as exc:  # the batch is done and stored: a metric must not fail it
        log.warning("batch duration not recorded: %s", exc)


def _hash(raw: dict[bytes, bytes]) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in raw.items()}


class FleetCollector(Collector):
    """Builds the worker's metric families at scrape time."""

    def __init__(self, redis_client: redis.Redis, node: str, gpu: int | str, watch: WatchView,
                 engine: EngineView, gpus: int = 1) -> None:
        """``gpu``: the group's label (``3``, ``0-1``); ``gpus``: how many GPUs it has."""
        self.redis, self.node, self.watch, self.engine = redis_client, node, watch, engine
        self.labels, self.gpus = [str(gpu), node], gpus

    def _counters(self) -> Iterator[Metric]:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(NodeKeys(self.node).stats)
        pipe.hgetall(NodeKeys(self.node).prompts)
        pipe.hgetall(NodeKeys(self.node).batch_seconds)
        stats, prompts, batches = (_hash(raw) for raw in pipe.execute())
        tokens = CounterMetricFamily("fleet_output_tokens", "Output tokens generated (each "
                                     "prompt counted once).", labels=LABELS)
        tokens.add_metric(self.labels, stats.get("output_tokens", 0.0))
        yield tokens
        by_kind = CounterMetricFamily("fleet_prompts", "Prompts finished, by outcome.",
                                      labels=[*LABELS, "status"])
        for kind in PROMPT_KINDS:
            by_kind.add_metric([*self.labels, kind], prompts.get(kind, 0.0))
        yield by_kind
        yield self._histogram(batches)

    def _histogram(self, raw: dict[str, float]) -> Metric:
        hist = HistogramMetricFamily("fleet_batch_seconds", "Wall time of finished batches.",
                                     labels=LABELS)
        buckets, total = [], 0.0
        for le in BATCH_BUCKETS_S:
            total += raw.get(_bound(le), 0.0)
            buckets.append((_bound(le), total))
        hist.add_metric(self.labels, buckets, raw.get("sum", 0.0))
        return hist

    def _engine(self) -> Iterator[Metric]:
        restarts = CounterMetricFamily("fleet_engine_restarts", "Engine restarts by this "
                                       "worker (crashes, hangs, relaunches).", labels=LABELS)
        restarts.add_metric(self.labels, self.engine.restarts)
        yield restarts
        state = GaugeMetricFamily("fleet_engine_state", "1 for the engine's current state.",
                                  labels=[*LABELS, "state"])
        for s in EngineState:
            state.add_metric([*self.labels, s.value], float(self.engine.state is s))
        yield state
        yield _gauge("fleet_worker_gpus", "GPUs this worker's engine runs on (its group).",
                     self.labels, float(self.gpus))
        yield _gauge("fleet_worker_output_tokens_per_second",
                     "Recent output tokens/s of this worker.", self.labels,
                     self.watch.tokens_per_sec)
        sample = self.watch.engine
        for field, (name, doc) in ENGINE_GAUGES.items():
            value = getattr(sample, field, None)
            if value is not None:
                yield _gauge(name, doc, self.labels, float(value))

    def _jobs(self) -> Iterator[Metric]:
        jobs = job_progress.list_jobs(self.redis)
        state = GaugeMetricFamily("fleet_job_state", "1 for the job's current state (running, "
                                  "paused, cancelled, done); the same from every worker.",
                                  labels=["job", "state"])
        progress = GaugeMetricFamily("fleet_job_progress", "Fraction of the job's prompts "
                                     "with their final row.", labels=["job"])
        version = GaugeMetricFamily("fleet_job_dataset_version", "Number of the job's "
                                    "committed data-set version (0: none yet).", labels=["job"])
        failing = GaugeMetricFamily("fleet_job_quality_gate_failing", "1 for each quality gate "
                                    "the running job's first rows break (FLEET_QUALITY_EARLY_"
                                    "ROWS) or its committed data set failed.",
                                    labels=["job", "gate"])
        for j in jobs:
            for gate in (j["quality_failed"] if j["quality_failed"] is not None
                         else j["quality_warning"]):
                failing.add_metric([j["job"], gate], 1.0)
            for s in job_progress.STATES:
                state.add_metric([j["job"], s], float(j["state"] == s))
            progress.add_metric([j["job"]], float(j["progress"]))
            version.add_metric([j["job"]], float(j["dataset_version_number"] or 0))
        yield from (state, progress, version, failing)

    def collect(self) -> Iterator[Metric]:
        """Every family; the Redis-backed ones are left out while Redis is unreachable."""
        try:
            yield from self._counters()
            yield from self._jobs()
        except redis.RedisError as exc:
            log.warning("metrics: cannot read counters from Redis: %s", exc)
        yield from self._engine()


def _gauge(name: str, doc: str, labels: list[str], value: float) -> Metric:
    gauge = GaugeMetricFamily(name, doc, labels=LABELS)
    gauge.add_metric(labels, value)
    return gauge


class Exporter:
    """The ``/metrics`` HTTP server of one worker (a daemon thread of the main process)."""

    def __init__(self, collector: FleetCollector, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<Exporter {self.host}:{self.port} serving={self._server is not None}>"

    def start(self) -> bool:
        """Listen; False (and a warning) when the port is taken, the worker carries on."""
        try:
            self._server, self._thread = start_http_server(self.port, addr=self.host,
                                                           registry=self.registry)
        except OSError as exc:
            log.warning("metrics exporter not started on %s:%d: %s", self.host, self.port, exc)
            return False
        log.info("metrics exporter on http://%s:%d/metrics", self.host, self.port)
        return True

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
