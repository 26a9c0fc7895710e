"""Turn a snapshot's sections into named readings, each with the value and where it came from.

Every quantity has an ordered list of sources; the first one present wins. The order
follows SGLang's sources: the effective running cap comes from
``internal_states[i].effective_max_running_requests_per_dp``, ``/v1/loads`` or the scheduler's
startup line, never from the top-level ``max_running_requests`` of ``/server_info`` (the CLI
value); KV usage is the full-attention pool's (used / capacity tokens), because
``token_usage`` is ``max(kv, mamba)`` on hybrid models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from workers.engine.log import LogFacts, parse_log
from workers.engine.metrics import MetricSet, full_kv_usage, parse_metrics

Value = float | int | str | bool
Candidate = tuple[Value | None, str]

# Decode lines averaged for the log's throughput reading.
RECENT_DECODE_LINES = 5


@dataclass(frozen=True)
class Reading:
    """One number the tuner used, and its source."""

    name: str
    value: Value
    source: str

    def as_evidence(self) -> dict[str, Any]:
        """The JSON form used in ``diagnose --json``."""
        return {"name": self.name, "value": self.value, "source": self.source}


class Readings:
    """Named readings from one snapshot."""

    def __init__(self, readings: Mapping[str, Reading], log: LogFacts, metrics: MetricSet):
        self._readings = dict(readings)
        self.log = log
        self.metrics = metrics

    def __repr__(self) -> str:
        return f"<Readings {sorted(self._readings)}>"

    def __contains__(self, name: str) -> bool:
        return name in self._readings

    def get(self, name: str) -> Any:
        """The value of reading ``name``, or None."""
        reading = self._readings.get(name)
        return None if reading is None else reading.value

    def evidence(self, *names: str) -> list[dict[str, Any]]:
        """Evidence entries for the named readings that exist."""
        return [self._readings[n].as_evidence() for n in names if n in self._readings]


def _first(name: str, candidates: list[Candidate]) -> Reading | None:
    for value, source in candidates:
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
            value = int(value)  # counts arrive as floats from Prometheus and the log
        elif isinstance(value, float):
            value = round(value, 4)
        return Reading(name, value, source)
    return None


def _internal_states(info: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    states = info.get("internal_states") or []
    return [s for s in states if isinstance(s, Mapping)]


def _sum_states(info: Mapping[str, Any], key: str) -> int | None:
    found = [s[key] for s in _internal_states(info) if s.get(key) is not None]
    return int(sum(found)) if found else None


def _loads(loads: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [x for x in loads.get("loads") or [] if isinstance(x, Mapping)]


def _sum_loads(loads: Mapping[str, Any], key: str) -> float | None:
    found = [x[key] for x in _loads(loads) if x.get(key) is not None]
    return sum(found) if found else None


def _loads_kv_usage(loads: Mapping[str, Any]) -> float | None:
    used, total = _sum_loads(loads, "num_used_tokens"), _sum_loads(loads, "max_total_num_tokens")
    return used / total if used is not None and total else None


def _log_last(log: LogFacts, *keys: str) -> float | None:
    lines = log.decode_lines()
    return lines[-1].number(*keys) if lines else None


def _log_mean(log: LogFacts, key: str) -> float | None:
    found = [x for b in log.decode_lines()[-RECENT_DECODE_LINES:] if (x := b.number(key))]
    return round(sum(found) / len(found), 2) if found else None


@dataclass(frozen=True)
class _Sections:
    info: Mapping[str, Any]
    loads: Mapping[str, Any]
    log: LogFacts
    metrics: MetricSet
    gpu: Mapping[str, Any]
    client: Mapping[str, Any]


def _m(s: _Sections, name: str, how: str = "total") -> Candidate:
    value = s.metrics.total(name) if how == "total" else s.metrics.mean(name)
    return value, f"metrics {s.metrics.source(name)}"


def _running_and_queue(s: _Sections) -> dict[str, list[Candidate]]:
    return {
        "running": [
            _m(s, "num_running_reqs"),
            (_sum_loads(s.loads, "num_running_reqs"), "loads loads[].num_running_reqs"),
            (_log_last(s.log, "#running-req"), "log Decode batch #running-req"),
        ],
        "queued": [
            _m(s, "num_queue_reqs"),
            (_sum_loads(s.loads, "num_waiting_reqs"), "loads loads[].num_waiting_reqs"),
            (_log_last(s.log, "#queue-req"), "log Decode batch #queue-req"),
        ],
    }


def _caps(s: _Sections) -> dict[str, list[Candidate]]:
    sched = s.log.scheduler
    return {
        "effective_cap": [
            (
                _sum_states(s.info, "effective_max_running_requests_per_dp"),
                "server_info internal_states[].effective_max_running_requests_per_dp",
            ),
            (_sum_loads(s.loads, "max_running_requests"), "loads loads[].max_running_requests"),
            (sched and sched.max_running_requests, "log scheduler max_running_requests="),
        ],
        "cli_max_running_requests": [
            (s.info.get("max_running_requests"), "server_info max_running_requests (CLI value)"),
        ],
        "spec_reset_to": [
            (s.log.spec_reset_to, "log 'Max running requests is reset to … for speculative'"),
        ],
        "context_len": [
            (sched and sched.context_len, "log scheduler context_len="),
            (s.info.get("context_length"), "server_info context_length"),
        ],
    }


def _kv(s: _Sections) -> dict[str, list[Candidate]]:
    sched = s.log.scheduler
    return {
        "kv_tokens": [
            (sched and sched.max_total_num_tokens, "log scheduler max_total_num_tokens="),
            (s.info.get("max_total_num_tokens"), "server_info max_total_num_tokens"),
            (_sum_loads(s.loads, "max_total_num_tokens"), "loads loads[].max_total_num_tokens"),
            _m(s, "max_total_num_tokens"),
        ],
        "kv_used_tokens": [
            _m(s, "num_used_tokens"),
            (_sum_loads(s.loads, "num_used_tokens"), "loads loads[].num_used_tokens"),
            (_log_last(s.log, "#full token", "#token"), "log Decode batch #full token"),
        ],
        "kv_usage": [
            full_kv_usage(s.metrics),
            (_loads_kv_usage(s.loads), "loads loads[].num_used_tokens / max_total_num_tokens"),
            (_log_last(s.log, "full token usage"), "log Decode batch full token usage"),
            (_log_last(s.log, "token usage"), "log Decode batch token usage"),
        ],
        "mamba_usage": [
            _m(s, "mamba_usage", "mean"),
            (_log_last(s.log, "mamba usage"), "log Decode batch mamba usage"),
        ],
        "mamba_slots": [
            (
                s.log.mamba and s.log.mamba.slots,
                "log Mamba Cache is allocated max_mamba_cache_size",
            ),
            (
                _sum_states(s.info, "max_mamba_cache_size"),
                "server_info internal_states[].max_mamba_cache_size",
            ),
            (s.info.get("max_mamba_cache_size"), "server_info max_mamba_cache_size"),
        ],
    }


def _cache_hit_rate(s: _Sections) -> Candidate:
    # SGLang counts hits per source (device, host, storage_*); a "total" sample, where one is
    # exported, is one more source label, not a sum to add to them.
    per_source = [
        sample.value
        for sample in s.metrics.samples.get("cached_tokens_total", [])
        if sample.labels.get("cache_source", "") != "total"
    ]
    cached = sum(per_source) if per_source else s.metrics.total(
        "cached_tokens_total", cache_source="total"
    )
    prompt = s.metrics.total("prompt_tokens_total")
    if cached is not None and prompt:
        name = s.metrics.source("cached_tokens_total")
        return round(cached / prompt, 4), f"metrics {name} / prompt_tokens_total"
    return None, ""


def _realtime_hit_rate(s: _Sections) -> Candidate:
    computed = s.metrics.total("realtime_tokens_total", mode="prefill_compute")
    if not computed:
        return None, ""
    cached = s.metrics.total("realtime_tokens_total", mode="prefill_cache") or 0.0
    name = s.metrics.source("realtime_tokens_total")
    return round(cached / (cached + computed), 4), f"metrics {name} prefill_cache / prefill"


def _prefill_share(s: _Sections) -> Candidate:
    """Prefill's share of the tokens the engine processed (realtime_tokens_total by mode)."""
    decode = s.metrics.total("realtime_tokens_total", mode="decode")
    computed = s.metrics.total("realtime_tokens_total", mode="prefill_compute") or 0.0
    cached = s.metrics.total("realtime_tokens_total", mode="prefill_cache") or 0.0
    if not decode:
        return None, ""
    name = s.metrics.source("realtime_tokens_total")
    share = (computed + cached) / (computed + cached + decode)
    return round(share, 4), f"metrics {name} prefill / (prefill + decode)"


def _speed(s: _Sections) -> dict[str, list[Candidate]]:
    return {
        "gen_throughput": [
            _m(s, "gen_throughput"),
            (_sum_loads(s.loads, "gen_throughput") or None, "loads loads[].gen_throughput"),
            (_log_mean(s.log, "gen throughput (token/s)"), "log Decode batch gen throughput"),
        ],
        "accept_length": [
            _m(s, "spec_accept_length", "mean"),
            (_log_last(s.log, "accept len"), "log Decode batch accept len"),
        ],
        "prefill_share": [_prefill_share(s)],
        "cache_hit_rate": [
            # Not loads[].cache_hit_rate: it is the last prefill batch's, reset at every
            # decode log, so it cannot say whether prompts share prefixes (``report_decode_stats``).
            _cache_hit_rate(s),
            _realtime_hit_rate(s),
        ],
    }


def _gpu_and_client(s: _Sections) -> dict[str, list[Candidate]]:
    out: dict[str, list[Candidate]] = {}
    for key in ("memory_total_mib", "memory_used_mib", "memory_free_mib", "utilization_gpu_pct"):
        out[f"gpu_{key}"] = [(s.gpu.get(key), f"nvml {key}")]
    out["gpu_power_w"] = [(s.gpu.get("power_w"), "nvml power_w")]
    out["client_in_flight"] = [(s.client.get("in_flight"), "client heartbeat in_flight")]
    out["client_queued_batches"] = [(s.client.get("queued_batches"), "client queued batches")]
    return out


_GROUPS: tuple[Callable[[_Sections], dict[str, list[Candidate]]], ...] = (
    _running_and_queue,
    _caps,
    _kv,
    _speed,
    _gpu_and_client,
)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def read_snapshot(snapshot: Mapping[str, Any]) -> Readings:
    """All readings available in ``snapshot`` (absent sections simply give fewer readings)."""
    sections = _Sections(
        info=_mapping(snapshot.get("server_info")),
        loads=_mapping(snapshot.get("loads")),
        log=parse_log(snapshot.get("log") or ""),
        metrics=parse_metrics(snapshot.get("metrics") or ""),
        gpu=_mapping(snapshot.get("gpu")),
        client=_mapping(snapshot.get("client")),
    )
    readings: dict[str, Reading] = {}
    for group in _GROUPS:
        for name, candidates in group(sections).items():
            found = _first(name, candidates)
            if found is not None:
                readings[name] = found
    return Readings(readings, sections.log, sections.metrics)
