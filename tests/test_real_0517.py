"""SGLang 0.5.17 on the lent H200: its formats against the fleet's table of traits
(fixtures/sglang/0.5.17/real-h200; the pool arithmetic is in tests/test_real_pools.py).

The traits of 0.5.17 were read from its wheel (docs/sglang_releases.md). Here each one the
fleet reads is checked against what the real engine wrote: its start-up log lines (the fleet's
log reader leaves none unread), ``/server_info``, ``/v1/loads`` and ``/metrics``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from workers.engine import releases
from workers.engine.log import parse_log

REAL = Path(__file__).parent / "fixtures" / "sglang" / "0.5.17" / "real-h200"
TRAITS = releases.traits("0.5.17")


def _json(name: str) -> dict:
    text = (REAL / "llama8b" / name).read_text()
    assert text.startswith("STATUS: 200")
    return json.loads(text[text.index("{"):])


@pytest.mark.parametrize("stage", ["llama8b", "big80_unhealthy", "falcon_h1_7b"])
def test_every_start_up_line_is_read_in_its_0_5_17_format(stage: str) -> None:
    text = (REAL / stage / "server.log").read_text()
    log = parse_log(text)
    assert log.unread == [] and log.kv_tokens and log.weights_gib
    # "KV Cache is allocated. dtype: torch.bfloat16, #tokens: …" (0.5.13 on)
    assert TRAITS.kv_line_dtype and "KV Cache is allocated. dtype: torch.bfloat16" in text
    if "--disable-cuda-graph" in (REAL / stage / "argv.txt").read_text().split():
        assert "CUDA graph begin" not in text  # Falcon-H1: no graph captured, none logged
        return
    # named graph lines ("Capture target … CUDA graph begin. backend=…"), no "Capture cuda graph bs"
    assert TRAITS.graph_line == "named" and not TRAITS.graph_bs_line
    assert re.search(r"Capture target \w+ CUDA graph begin\. backend=\w+", text)
    assert "Capture cuda graph bs" not in text


def test_server_info_and_loads_have_the_0_5_17_fields() -> None:
    info = _json("server_info.txt")
    assert info["version"] == "0.5.17"
    assert TRAITS.server_info_startup_time and "startup_time" in info
    usage = info["internal_states"][0]["memory_usage"]
    assert TRAITS.memory_usage_graph == "by_phase" and isinstance(usage["graph"], dict)
    assert {"startup_available", "token_capacity_swa"} <= set(usage)
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 4096
    loads = _json("v1_loads.txt")
    assert TRAITS.loads_accelerator and loads["num_accelerators"] == 1
    assert not TRAITS.loads_aggregate and "aggregate" not in loads
    assert "num_total_reqs" not in loads["loads"][0]
    assert loads["loads"][0]["max_running_requests"] == 4096
    assert loads["loads"][0]["max_total_num_tokens"] == 910_372


def test_the_request_counters_carry_is_streaming() -> None:
    metrics = (REAL / "llama8b" / "metrics.txt").read_text()
    assert TRAITS.metric_is_streaming
    for name in ("generation_tokens_total", "prompt_tokens_total", "num_requests_total"):
        line = next(x for x in metrics.splitlines() if x.startswith(f"sglang:{name}{{"))
        assert 'is_streaming="false"' in line
