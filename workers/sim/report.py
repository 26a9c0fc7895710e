"""SGLang's log lines and Prometheus metrics, fed by the simulated scheduler.

Log lines use SGLang's exact f-strings and format (``srt/utils/common.py::configure_logger``,
``observability/scheduler_metrics_mixin.py``, 0.5.11): ``[%Y-%m-%d %H:%M:%S] msg``
with no prefix at tp = dp = 1, ``GB`` meaning GiB, printed to stdout and flushed. Metric names,
labels and update cadence follow ``observability/metrics_collector.py`` (``sglang:`` colon
names, gauges written on every prefill round and every ``--decode-log-interval`` decode
steps; token counters per step; request counters when a request finishes).

Rate limit: when FLEET_SIM_SPEED > 1, at most one ``Prefill batch`` and one ``Decode batch`` line
per :data:`MIN_LOG_INTERVAL_S` of real time are printed (5 lines/s per kind); the skipped lines'
numbers still reach the gauges (refreshed at most 100 times a second then; going idle always
refreshes them). At real speed nothing is skipped.
"""

from __future__ import annotations

import os
import sys
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from workers.sim.engine import Interval, SimRequest, Snapshot

GB = 1024**3
MIN_LOG_INTERVAL_S = 0.2
# Gauge refreshes are also capped (at 100/s) when FLEET_SIM_SPEED > 1; going idle always writes.
MIN_GAUGE_INTERVAL_S = 0.01
# Buckets of sglang:e2e_request_latency_seconds (srt/observability/metrics_collector.py).
E2E_BUCKETS = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1,
    2,
    4,
    6,
    8,
    10,
    20,
    40,
    60,
    80,
    100,
    200,
    400,
    600,
    1200,
    1800,
    2400,
)


def log(message: str, prefix: str = "") -> None:
    """Print one SGLang-format log line (``[time{prefix}] message``) and flush."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.stdout.write(f"[{stamp}{prefix}] {message}\n")
    sys.stdout.flush()


def usage_part(snap: Snapshot, hybrid: bool, decode: bool) -> str:
    """The ``{usage}`` part of the prefill/decode lines (each item followed by ', ')."""
    if hybrid and decode:
        return (
            f"#full token: {snap.used_tokens}, full token usage: {snap.full_usage:.2f}, "
            f"mamba num: {snap.mamba_num}, mamba usage: {snap.mamba_usage:.2f}, "
        )
    if hybrid:
        return f"full token usage: {snap.full_usage:.2f}, mamba usage: {snap.mamba_usage:.2f}, "
    if decode:
        return f"#token: {snap.used_tokens}, token usage: {snap.full_usage:.2f}, "
    return f"token usage: {snap.full_usage:.2f}, "


class SimMetrics:
    """SGLang's Prometheus metrics in a private registry."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # SGLang's multiprocess collector exports no *_created
        self.registry = CollectorRegistry()
        sched = {
            "model_name": model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        names = list(sched)
        self.sched = sched
        self.gauges = {
            name: Gauge(f"sglang:{name}", doc, names, registry=self.registry).labels(**sched)
            for name, doc in GAUGES.items()
        }
        # SchedulerMetricsCollector gives these two a pid label (multiprocess "livesum").
        pid = {**sched, "pid": str(os.getpid())}
        for name in ("num_retracted_reqs", "num_paused_reqs"):
            Gauge(f"sglang:{name}", name, list(pid), registry=self.registry).labels(**pid)
        # Children of a labelled counter appear on first increment, as in SGLang: a mode, a
        # cache source or a retraction that never happened has no sample.
        self.realtime = Counter(
            "sglang:realtime_tokens",
            "Total number of tokens processed (updated on each log interval). "
            "mode: prefill_compute, prefill_cache, decode.",
            [*names, "mode"],
            registry=self.registry,
        )
        self.retracted = Counter(
            "sglang:num_retracted_requests",
            "Requests retracted from the running batch.",
            names,
            registry=self.registry,
        )
        # TokenizerMetricsCollector's labels: model_name and engine_type.
        tok = {"model_name": model_name, "engine_type": "unified"}
        self._families: dict[str, Counter | Histogram] = {}
        self._request_counters(tok)
        # Tokenizer-side, per finished request, by where the hit was found (device: GPU KV).
        self.cached_tokens = Counter(
            "sglang:cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            [*tok, "cache_source"],
            registry=self.registry,
        )
        self.tok = tok

    def _request_counters(self, labels: dict[str, str]) -> None:
        """The per-request counters and latency histogram, labelled ``labels``."""
        for family in self._families.values():
            self.registry.unregister(family)
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens (finished).", labels)
        self.generation_tokens = self._counter(
            "generation_tokens", "Generated tokens (finished).", labels
        )
        self.num_requests = self._counter("num_requests", "Finished requests.", labels)
        family = Histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end latency.",
            list(labels),
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self._families["e2e"] = family
        self.e2e = family.labels(**labels)

    def use_release(self, streaming_label: bool) -> None:
        """Label the request counters as the played release does, before any request: from
        0.5.17 they carry ``is_streaming`` (``TokenizerMetricsCollector``; never streamed here)."""
        if streaming_label:
            self._request_counters({**self.tok, "is_streaming": "false"})

    def _counter(self, name: str, doc: str, labels: dict[str, str]) -> Counter:
        """A tokenizer-side counter (the labelled child)."""
        family = Counter(f"sglang:{name}", doc, list(labels), registry=self.registry)
        self._families[name] = family
        return family.labels(**labels)

    def count_tokens(self, mode: str, tokens: int) -> None:
        """``increment_realtime_tokens``: ``sglang:realtime_tokens_total{mode}``."""
        self.realtime.labels(**self.sched, mode=mode).inc(tokens)

    def set(self, **values: float) -> None:
        """Set gauges by short name."""
        for name, value in values.items():
            self.gauges[name].set(value)

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)


GAUGES = {
    "num_running_reqs": "The number of running requests.",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "num_used_tokens": "The number of used tokens.",
    "token_usage": "The token usage (max over pools).",
    "full_token_usage": "The token usage of the full-attention pool.",
    "mamba_usage": "The usage of the Mamba pool.",
    "gen_throughput": "The generation throughput (token/s).",
    "max_total_num_tokens": "Maximum total number of tokens in the KV pool.",
    "spec_accept_length": "The average acceptance length of speculative decoding.",
    "spec_accept_rate": "The average acceptance rate of speculative decoding.",
    "context_len": "The context length.",
    "page_size": "The page size of the KV pool.",
    "num_pages": "The number of pages of the KV pool.",
    "startup_available_gpu_memory_gb": "GPU memory left after start-up (GB).",
    "new_token_ratio": "The new token ratio of the scheduler.",
    "kv_used_tokens": "KV tokens in use.",
    "kv_available_tokens": "KV tokens available.",
    "decode_sum_seq_lens": "Sum of the sequence lengths of the running batch.",
    "is_cuda_graph": "Whether the last batch ran a CUDA graph.",
    "cache_hit_rate": "The prefix cache hit rate.",
    "utilization": "The utilization.",
    "swa_token_usage": "The token usage of the SWA pool.",
    "num_grammar_queue_reqs": "The number of requests in the grammar queue.",
}


class Reporter:
    """The scheduler's observer: writes SGLang's log lines and metrics."""

    def __init__(
        self,
        metrics: SimMetrics | None,
        hybrid: bool,
        speculative: bool,
        graph_max_bs: int,
        rate_limited: bool,
        prefix: str = "",
        pending_token: bool = True,
    ) -> None:
        self.metrics = metrics
        self.pending_token = pending_token  # 0.5.11's "#pending-token: N, " in prefill lines
        self.hybrid = hybrid
        self.speculative = speculative
        self.graph_max_bs = graph_max_bs
        self.min_interval = MIN_LOG_INTERVAL_S if rate_limited else 0.0
        self.prefix = prefix
        self._last_line = {"prefill": 0.0, "decode": 0.0, "gauges": 0.0}
        self.min_gauge_interval = MIN_GAUGE_INTERVAL_S if rate_limited else 0.0
        self._last_prefill = time.monotonic()
        self.interval = Interval(0.0, 0.0, 0.0)

    def _may_log(self, kind: str) -> bool:
        """Rate limit per line kind (only when the sim runs faster than real time)."""
        now = time.monotonic()
        if now - self._last_line[kind] < self.min_interval:
            return False
        self._last_line[kind] = now
        return True

    def _gauges(self, snap: Snapshot, force: bool = False) -> None:
        """Write the scheduler gauges from a snapshot and the last interval."""
        if self.metrics is None:
            return
        now = time.monotonic()
        if not force and now - self._last_line["gauges"] < self.min_gauge_interval:
            return
        self._last_line["gauges"] = now
        token_usage = max(snap.full_usage, snap.mamba_usage) if self.hybrid else snap.full_usage
        self.metrics.set(
            num_running_reqs=snap.running,
            num_queue_reqs=snap.queued,
            num_used_tokens=snap.used_tokens,
            token_usage=token_usage,
            full_token_usage=snap.full_usage,
            mamba_usage=snap.mamba_usage,
            kv_used_tokens=snap.used_tokens,
            kv_available_tokens=snap.total_tokens - snap.used_tokens,
            decode_sum_seq_lens=snap.used_tokens,
            new_token_ratio=snap.new_token_ratio,
            is_cuda_graph=float(0 < snap.running <= self.graph_max_bs),
            gen_throughput=self.interval.gen_throughput,
            spec_accept_length=self.interval.accept_length,
            spec_accept_rate=self.interval.accept_rate,
        )

    def on_step(self, decode_tokens: int, prefill_tokens: int, cached_tokens: int = 0) -> None:
        """Count tokens computed (or taken from the cache) by this step (realtime_tokens)."""
        if self.metrics is None:
            return
        if decode_tokens:
            self.metrics.count_tokens("decode", decode_tokens)
        if prefill_tokens:
            self.metrics.count_tokens("prefill_compute", prefill_tokens)
        if cached_tokens:
            self.metrics.count_tokens("prefill_cache", cached_tokens)

    def on_prefill(
        self, new_reqs: int, new_tokens: int, cached: int, running_before: int, snap: Snapshot
    ) -> None:
        """Gauges and the ``Prefill batch`` line of one admission round."""
        self._gauges(snap)
        now = time.monotonic()
        throughput = new_tokens / max(now - self._last_prefill, 1e-9)
        self._last_prefill = now
        if not self._may_log("prefill"):
            return
        usage = usage_part(snap, self.hybrid, decode=False)
        pending = f"#pending-token: {snap.pending_tokens}, " if self.pending_token else ""
        log(
            f"Prefill batch, #new-seq: {new_reqs}, #new-token: {new_tokens}, "
            f"#cached-token: {cached}, "
            f"{usage}#running-req: {running_before}, "
            f"#queue-req: {snap.queued}, {pending}cuda graph: False, "
            f"input throughput (token/s): {throughput:.2f}",
            self.prefix,
        )

    def on_decode_interval(self, snap: Snapshot, interval: Interval) -> None:
        """Gauges and the ``Decode batch`` line every ``--decode-log-interval`` steps."""
        self.interval = interval
        self._gauges(snap)
        if not self._may_log("decode"):
            return
        spec = ""
        if self.speculative:
            spec = (
                f"accept len: {interval.accept_length:.2f}, "
                f"accept rate: {interval.accept_rate:.2f}, "
            )
        graph = 0 < snap.running <= self.graph_max_bs
        log(
            f"Decode batch, #running-req: {snap.running}, {usage_part(snap, self.hybrid, True)}"
            f"{spec}cuda graph: {graph}, gen throughput (token/s): {interval.gen_throughput:.2f}, "
            f"#queue-req: {snap.queued}",
            self.prefix,
        )

    def on_finish(self, req: SimRequest) -> None:
        """Tokenizer-side counters of a finished request."""
        if self.metrics is None:
            return
        self.metrics.prompt_tokens.inc(req.input_len)
        self.metrics.generation_tokens.inc(req.generated)
        self.metrics.num_requests.inc()
        if req.cached_tokens:
            labels = {**self.metrics.tok, "cache_source": "device"}
            self.metrics.cached_tokens.labels(**labels).inc(req.cached_tokens)
        self.metrics.e2e.observe(req.latency)

    def on_idle(self, snap: Snapshot) -> None:
        """Idle gauges (SGLang rewrites them every 30 s with gen_throughput=0; the sim at once)."""
        self.interval = Interval(0.0, 0.0, 0.0)
        self._gauges(snap, force=True)

    def on_retract(self, count: int, old_ratio: float, new_ratio: float) -> None:
        """The scheduler's retraction line (``Scheduler.update_running_batch``)."""
        if self.metrics is not None:
            self.metrics.retracted.labels(**self.metrics.sched).inc(count)
        log(
            f"KV cache pool is full. Retract requests. #retracted_reqs: {count}, "
            f"#new_token_ratio: {old_ratio:.4f} -> {new_ratio:.4f}",
            self.prefix,
        )

    def on_crash(self, req: SimRequest) -> None:
        """The line printed before the fault-injected crash."""
        log(
            f"Scheduler hit an exception: RuntimeError: simulated engine crash (sim fault "
            f"injection: request {req.rid} contains __SIM_CRASH__)",
            self.prefix,
        )
