"""Read SGLang's Prometheus text (``/metrics``) under either spelling of its names.

The engine exports ``sglang:num_running_reqs``; routers, some dashboards and
``/v1/loads?format=prometheus`` write ``sglang_num_running_reqs`` (github.com/sgl-project/sglang
pull 12970). Samples are stored under the bare name (``num_running_reqs``), remembering the
spelling they came with so evidence can cite the exact metric.

The names and labels the fleet reads are the same in every release from 0.5.10.post1 to 0.5.23
(``observability/metrics_collector.py``): the scheduler's gauges carry ``model_name``,
``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank`` (and ``dp_rank`` under DP);
from 0.5.17 the per-request counters and ``e2e_request_latency_seconds`` also carry
``is_streaming``, whose two series a total adds up like any other split.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$"
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_PREFIXES = ("sglang:", "sglang_")
# Every metric the fleet reads (bare names: gauges, then counters with their _total).
FLEET_METRICS = (
    "num_running_reqs", "num_queue_reqs", "num_used_tokens", "max_total_num_tokens",
    "token_usage", "full_token_usage", "mamba_usage", "gen_throughput", "spec_accept_length",
    "realtime_tokens_total", "prompt_tokens_total", "generation_tokens_total",
    "num_requests_total", "cached_tokens_total",
)


@dataclass(frozen=True)
class Sample:
    """One sample line: its labels and value."""

    labels: dict[str, str]
    value: float


@dataclass
class MetricSet:
    """Samples by bare metric name (``sglang:`` / ``sglang_`` prefix removed)."""

    samples: dict[str, list[Sample]] = field(default_factory=dict)
    spelling: dict[str, str] = field(default_factory=dict)

    def __contains__(self, name: str) -> bool:
        return name in self.samples

    def source(self, name: str) -> str:
        """The metric's name as the engine wrote it, for evidence."""
        return f"{self.spelling.get(name, 'sglang:')}{name}"

    def values(self, name: str, **labels: str) -> list[float]:
        """One value per scheduler (DP rank) of ``name`` whose labels include ``labels``.

        Samples a scheduler repeats are counted once: with
        ``--enable-metrics-for-all-schedulers`` every TP/PP rank exports the same scheduler
        gauges (rank 0's are kept), and a figure exported both as a whole and split by
        ``priority`` is taken whole (the split ones are summed only when no whole one exists).
        NaN samples are skipped.
        """
        groups: dict[str, list[Sample]] = {}
        for sample in self.samples.get(name, []):
            if math.isnan(sample.value):
                continue
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                groups.setdefault(sample.labels.get("dp_rank", "0"), []).append(sample)
        return [_scheduler_value(group) for _, group in sorted(groups.items())]

    def total(self, name: str, **labels: str) -> float | None:
        """Sum over schedulers (e.g. over DP ranks), or None if there are none."""
        found = self.values(name, **labels)
        return sum(found) if found else None

    def mean(self, name: str, **labels: str) -> float | None:
        """Mean over schedulers (for ratios such as usage), or None."""
        found = self.values(name, **labels)
        return sum(found) / len(found) if found else None


def _rank(sample: Sample) -> tuple[int, int]:
    def number(key: str) -> int:
        text = sample.labels.get(key, "0")
        return int(text) if text.isdigit() else 0

    return number("tp_rank"), number("pp_rank")


def _scheduler_value(group: list[Sample]) -> float:
    """One scheduler's value from its samples (lowest TP/PP rank; whole before priorities)."""
    first = min(_rank(s) for s in group)
    group = [s for s in group if _rank(s) == first]
    whole = [s for s in group if "priority" not in s.labels]
    return sum(s.value for s in (whole or group))


def _bare(name: str) -> tuple[str, str] | None:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return prefix, name[len(prefix) :]
    return None


def parse_metrics(text: str) -> MetricSet:
    """Parse Prometheus exposition text, keeping only SGLang's metrics."""
    metrics = MetricSet()
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        bare = _bare(match.group("name"))
        if bare is None:
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        prefix, name = bare
        labels = dict(_LABEL.findall(match.group("labels") or ""))
        metrics.samples.setdefault(name, []).append(Sample(labels, value))
        metrics.spelling.setdefault(name, prefix)
    return metrics


def full_kv_usage(metrics: MetricSet) -> tuple[float | None, str]:
    """Usage of the full-attention KV pool, never the Mamba pool's, and the metrics it came from.

    ``sglang:token_usage`` is ``max(full_token_usage, mamba_usage)`` on hybrid SSM models
    (``SchedulerMetricsMixin.log_decode_stats``, 0.5.10-0.5.11) and ``full_token_usage`` /
    ``mamba_usage`` are exported, as 0, by every model, so neither name says which kind of model
    it is. ``num_used_tokens / max_total_num_tokens`` is the full pool on every model; the
    gauges are the fallback, and ``token_usage`` only counts while no Mamba slot is in use.
    """
    used, total = metrics.total("num_used_tokens"), metrics.total("max_total_num_tokens")
    if used is not None and total:
        names = f"{metrics.source('num_used_tokens')} / {metrics.source('max_total_num_tokens')}"
        return used / total, f"metrics {names}"
    full = metrics.mean("full_token_usage")
    if full:
        return full, f"metrics {metrics.source('full_token_usage')}"
    if metrics.mean("mamba_usage"):
        return None, ""
    return metrics.mean("token_usage"), f"metrics {metrics.source('token_usage')}"
