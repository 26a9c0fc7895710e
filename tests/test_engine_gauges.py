"""The heartbeat's engine gauges read SGLang's /metrics as SGLang means them (issue #13)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.gauges import sample_from
from workers.tune.engine_metrics import parse_metrics

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
