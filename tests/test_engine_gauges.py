"""The heartbeat's engine gauges read SGLang's /metrics as SGLang means them (issue #13)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engine.metrics import parse_metrics
from workers.observe.gauges import sample_from

SNAPSHOTS = Path(__file__).parent / "fixtures" / "tune" / "snapshots"


def _hybrid_metrics() -> str:
    return (SNAPSHOTS / "baseline_mamba_slots" / "metrics.txt").read_text()


def test_kv_gauge_is_the_full_kv_pool_not_mamba_usage_on_a_hybrid_model() -> None:
    text = _hybrid_metrics()
    m = parse_metrics(text)
    used, total = m.total("num_used_tokens"), m.total("max_total_num_tokens")
    # token_usage is max(full, mamba) there: the Mamba pool's figure.
    assert m.mean("token_usage") == pytest.approx(m.mean("mamba_usage"), abs=0.01)
    sample = sample_from(text, None)
    assert sample is not None
    assert sample.kv_usage == pytest.approx(used / total)
    assert sample.kv_usage < 0.1
    assert sample.mamba_usage == m.mean("mamba_usage")


def test_kv_gauge_from_loads_is_used_over_capacity_tokens() -> None:
    loads = {"loads": [{"num_running_reqs": 16, "num_waiting_reqs": 3, "num_used_tokens": 1000,
                        "max_total_num_tokens": 100000, "token_usage": 0.74,
                        "max_running_requests": 16}]}
    sample = sample_from(None, loads)
    assert sample is not None and sample.kv_usage == pytest.approx(0.01)


def _line(name: str, value: float, **labels: str) -> str:
    base = {"model_name": "m", "engine_type": "unified", **labels}
    inner = ",".join(f'{k}="{v}"' for k, v in base.items())
    return f"sglang:{name}{{{inner}}} {value}"


def test_a_scheduler_repeated_by_tp_ranks_or_split_by_priority_counts_once() -> None:
    text = "\n".join([
        # --enable-metrics-for-all-schedulers: TP1 repeats TP0's gauges; two DP ranks add up.
        _line("num_running_reqs", 16, dp_rank="0", tp_rank="0", pp_rank="0"),
        _line("num_running_reqs", 16, dp_rank="0", tp_rank="1", pp_rank="0"),
        _line("num_running_reqs", 12, dp_rank="1", tp_rank="0", pp_rank="0"),
        # The queue as a whole and split by priority.
        _line("num_queue_reqs", 10, tp_rank="0"),
        _line("num_queue_reqs", 4, tp_rank="0", priority="0"),
        _line("num_queue_reqs", 6, tp_rank="0", priority="1"),
        _line("token_usage", 0.5, tp_rank="0"),
        _line("mamba_usage", 0.0, tp_rank="0"),  # exported by every model, even a dense one
        _line("full_token_usage", 0.0, tp_rank="0"),
    ])
    m = parse_metrics(text)
    assert m.total("num_running_reqs") == 28
    only_priorities = "\n".join(x for x in text.splitlines()
                                if "num_queue_reqs" not in x or "priority" in x)
    assert m.total("num_queue_reqs") == parse_metrics(only_priorities).total("num_queue_reqs")
    sample = sample_from(text, None)
    assert sample is not None and (sample.running, sample.queued) == (28, 10)
    assert sample.kv_usage == 0.5  # dense: token_usage is the KV pool's


def test_cache_hit_rate_sums_the_sources_without_the_total_label() -> None:
    from workers.tune.readings import read_snapshot

    text = "\n".join([
        'sglang:cached_tokens_total{model_name="m",cache_source="device"} 100',
        'sglang:cached_tokens_total{model_name="m",cache_source="host"} 50',
        'sglang:cached_tokens_total{model_name="m",cache_source="total"} 150',
        'sglang:prompt_tokens_total{model_name="m"} 1000',
    ])
    rate = read_snapshot({"metrics": text}).get("cache_hit_rate")
    assert rate == pytest.approx(0.15)
