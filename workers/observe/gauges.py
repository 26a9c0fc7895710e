"""What a worker's main process samples for observers: engine gauges and its recent tokens/s.

One thread (:class:`WorkerWatch`) wakes every heartbeat interval, reads the engine's own numbers
(``/metrics`` when it runs with ``--enable-metrics``; ``/v1/loads`` for the *effective* running
cap and as a fallback) and this worker's output-token counter in Redis, and caches the result.
The heartbeat, Flower's ``inspect stats`` (answered on Celery's consumer thread) and the
Prometheus exporter read only this cache, so none of them ever waits on the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx
import orjson
import redis

from workers.engine.client import effective_cap
from workers.engine.metrics import MetricSet, full_kv_usage, parse_metrics
from workers.redisdb.keys import NodeKeys

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
# A scrape that fails or comes back partial (a busy engine answering slowly) is filled in from
# the last full sample this recent, so Flower and `status` do not flicker to "unknown".
KEEP_LAST_S = 10.0


@dataclass(frozen=True)
class EngineSample:
    """The engine's load at one moment (None where the engine did not say)."""

    running: int | None = None
    queued: int | None = None
    cap: int | None = None
    kv_usage: float | None = None
    mamba_usage: float | None = None
    accept_length: float | None = None
    gen_throughput: float | None = None


def _from_metrics(m: MetricSet) -> dict[str, float | None]:
    return {
        "running": m.total("num_running_reqs"), "queued": m.total("num_queue_reqs"),
        "kv_usage": full_kv_usage(m)[0], "mamba_usage": m.mean("mamba_usage"),
        "accept_length": m.mean("spec_accept_length"),
        "gen_throughput": m.total("gen_throughput"),
    }


def _rank_kv_usage(rank: dict[str, Any]) -> float:
    """Full-KV usage of one /v1/loads rank: used / capacity tokens (its ``token_usage`` may be
    the Mamba pool's on hybrid models)."""
    total = float(rank.get("max_total_num_tokens") or 0)
    if total and rank.get("num_used_tokens") is not None:
        return float(rank["num_used_tokens"]) / total
    return float(rank.get("token_usage") or 0)


def _from_loads(loads: dict[str, Any]) -> dict[str, float | None]:
    ranks = loads.get("loads") or []
    if not ranks:
        return {}
    spec = [float(s["accept_length"]) for r in ranks
            if isinstance(s := r.get("speculative"), dict) and s.get("accept_length") is not None]
    return {
        "running": sum(float(r.get("num_running_reqs") or 0) for r in ranks),
        "queued": sum(float(r.get("num_waiting_reqs") or 0) for r in ranks),
        "kv_usage": max(_rank_kv_usage(r) for r in ranks),
        "accept_length": sum(spec) / len(spec) if spec else None,
        "gen_throughput": sum(float(r.get("gen_throughput") or 0) for r in ranks),
    }


# What /v1/loads reads from the scheduler on every request: its running and waiting counts
# are current, where /metrics' gauges are written at decode-log steps and, once the engine is
# idle, only every 30 s (SGLang), so they can still show the end of a job long after it.
LIVE_FROM_LOADS = ("running", "queued")


def sample_from(metrics_text: str | None, loads: dict[str, Any] | None) -> EngineSample | None:
    """Combine /metrics (preferred, but for :data:`LIVE_FROM_LOADS`) and /v1/loads; None when
    neither was readable."""
    if metrics_text is None and loads is None:
        return None
    values: dict[str, Any] = _from_loads(loads or {})
    if metrics_text is not None:
        found = _from_metrics(parse_metrics(metrics_text))
        values.update({k: v for k, v in found.items() if v is not None
                       and not (k in LIVE_FROM_LOADS and values.get(k) is not None)})
    for name in ("running", "queued"):  # request counts are whole numbers
        if values.get(name) is not None:
            values[name] = int(values[name])
    return EngineSample(cap=effective_cap(loads, None), **values)


class RateWindow:
    """Rate of a growing counter over the last ``window_s`` seconds of samples."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, value: int) -> None:
        """Record the counter's value at monotonic time ``now``."""
        if self._samples and value < self._samples[-1][1]:
            self._samples.clear()  # the counter was reset (Redis lost it): start over
        self._samples.append((now, value))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def rate(self) -> float:
        """Increase per second between the oldest and newest sample in the window."""
        if len(self._samples) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self._samples[0], self._samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


class WorkerWatch:
    """A thread caching the engine's gauges and this worker's token counter and rate."""

    def __init__(self, base_url: str, redis_client: redis.Redis, node: str, interval_s: float,
                 window_s: float) -> None:
        self.redis, self.node, self.interval_s = redis_client, node, interval_s
        self._http = httpx.Client(base_url=base_url, timeout=SCRAPE_TIMEOUT_S)
        self._rate = RateWindow(window_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fleet-watch", daemon=True)
        self.engine: EngineSample | None = None
        self._full_at = -KEEP_LAST_S  # monotonic time of the last sample with running and cap
        self.read_at: float | None = None  # wall time of the last engine sample
        self.output_tokens = 0
        self.tokens_per_sec = 0.0

    def __repr__(self) -> str:
        return (f"<WorkerWatch {self.node} tokens={self.output_tokens} "
                f"tok/s={self.tokens_per_sec:.0f}>")

    def start(self) -> None:
        """Start sampling in the background."""
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (idempotent)."""
        self._stop.set()

    def _get(self, path: str) -> httpx.Response | None:
        try:
            resp = self._http.get(path)
        except httpx.HTTPError:
            return None
        return resp if resp.status_code == 200 else None

    def _scrape_engine(self) -> EngineSample | None:
        metrics = self._get("/metrics")
        loads = self._get("/v1/loads")
        try:
            doc = orjson.loads(loads.content) if loads is not None else None
        except orjson.JSONDecodeError:
            doc = None
        return sample_from(metrics.text if metrics is not None else None,
                           doc if isinstance(doc, dict) else None)

    def tick(self) -> None:
        """Take one sample of the engine and of the token counter."""
        sample, now, self.read_at = self._scrape_engine(), time.monotonic(), time.time()
        if sample is not None and sample.running is not None and sample.cap is not None:
            self.engine, self._full_at = sample, now
        elif self.engine is not None and now - self._full_at <= KEEP_LAST_S:
            known = asdict(sample) if sample is not None else {}
            self.engine = replace(self.engine, **{k: v for k, v in known.items() if v is not None})
        else:
            self.engine = sample
        raw = self.redis.hget(NodeKeys(self.node).stats, "output_tokens")
        self.output_tokens = int(raw or 0)
        self._rate.add(time.monotonic(), self.output_tokens)
        # An engine that runs and queues nothing now makes no tokens, whatever the window
        # still holds from the job that just ended.
        idle = self.engine is not None and self.engine.running == 0 and not self.engine.queued
        self.tokens_per_sec = 0.0 if idle else self._rate.rate()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except redis.RedisError as exc:
                log.warning("worker watch: cannot read counters: %s", exc)
            except Exception:  # a gauge thread that dies silently freezes every dashboard
                log.exception("worker watch: sample failed")
            self._stop.wait(self.interval_s)
        self._http.close()

    def engine_fields(self) -> dict[str, Any]:
        """Heartbeat fields from the last engine sample (None where unknown), with
        ``engine_read_at``, when it was read: a heartbeat may be sent a whole interval later."""
        sample = self.engine or EngineSample()
        fields = asdict(sample)
        fields.pop("gen_throughput")
        out = {k: round(v, 3) if isinstance(v, float) else v for k, v in fields.items()}
        return {**out, "engine_read_at": None if self.read_at is None else round(self.read_at, 3)}
