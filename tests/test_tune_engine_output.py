"""Reading SGLang's own output: startup log lines, batch lines, and /metrics in both spellings."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engine.log import parse_batch, parse_log
from workers.engine.metrics import parse_metrics
from workers.tune.situation import log_starts
from workers.tune.snapshot import read_log

SNAPSHOTS = Path(__file__).parent / "fixtures" / "tune" / "snapshots"
BASELINE = SNAPSHOTS / "baseline_mamba_slots"


def test_startup_lines_of_the_baseline_engine():
    facts = parse_log((BASELINE / "engine.log").read_text())
    assert facts.mamba is not None
    assert (facts.mamba.slots, facts.mamba.conv_gib, facts.mamba.ssm_gib) == (80, 0.22, 11.39)
    assert (facts.mamba.intermediate_ssm_gib, facts.mamba.intermediate_conv_gib) == (9.56, 0.19)
    # The target's KV pool, not the draft model's that is logged after it.
    assert facts.kv_tokens == 1137037 and facts.kv_gib == pytest.approx(34.70)
    assert (facts.weights_gib, facts.draft_weights_gib) == (54.0, 0.85)
    assert facts.weights_begin_avail_gib == 178.52
    assert facts.scheduler is not None
    assert facts.scheduler.max_running_requests == 16
    assert facts.scheduler.max_total_num_tokens == 1137037
    assert facts.scheduler.context_len == 8192
    assert facts.spec_reset_to == 48
    decode = facts.decode_lines()
    assert len(decode) == 5 and len(facts.batches) == 8
    assert decode[-1].number("#running-req") == 16 and decode[-1].number("#queue-req") == 32
    assert decode[-1].number("gen throughput (token/s)") == 2003.17
    assert decode[-1].fields["cuda graph"] is True


def test_a_restart_in_the_same_log_file_replaces_the_startup_facts():
    first = (BASELINE / "engine.log").read_text()
    second = (SNAPSHOTS / "compute_flat" / "engine.log").read_text()
    facts = parse_log(first + second)
    assert facts.mamba is not None and facts.mamba.slots == 200
    assert facts.scheduler is not None and facts.scheduler.max_running_requests == 40
    assert facts.spec_reset_to is None
    assert all(b.timestamp.startswith("2026-05-07 19:") for b in facts.batches)


def test_lines_with_rank_prefixes_and_plain_model_usage_fields():
    facts = parse_log((SNAPSHOTS / "explicit_flag" / "engine.log").read_text())
    assert facts.scheduler is not None and facts.scheduler.max_running_requests == 24
    assert facts.mamba is not None and facts.mamba.slots == 200
    line = parse_batch(
        "Decode batch [1200], #running-req: 123, #token: 1131960, token usage: 0.96, "
        "cuda graph: True, gen throughput (token/s): 6120.42, #queue-req: 212"
    )
    assert line is not None and line.kind == "decode"
    assert line.number("#full token", "#token") == 1131960
    assert line.number("token usage") == 0.96


def test_metrics_in_colon_and_underscore_spellings_read_the_same():
    colon = (BASELINE / "metrics.txt").read_text()
    underscore = colon.replace("sglang:", "sglang_")
    a, b = parse_metrics(colon), parse_metrics(underscore)
    for name in ("num_running_reqs", "num_queue_reqs", "full_token_usage", "mamba_usage"):
        assert a.total(name) == b.total(name) is not None
    assert a.total("num_running_reqs") == 16.0
    assert a.source("num_running_reqs") == "sglang:num_running_reqs"
    assert b.source("num_running_reqs") == "sglang_num_running_reqs"
    assert a.total("realtime_tokens_total", mode="decode") == 12964102.0
    assert a.total("cached_tokens_total", cache_source="total") == 19840.0
    # Histogram series keep their suffixes; other exporters' metrics are ignored.
    assert a.total("e2e_request_latency_seconds_count") == 5176.0
    assert "process_cpu_seconds_total" not in parse_metrics("process_cpu_seconds_total 3.0\n")


def test_read_log_keeps_the_latest_start_and_the_recent_batch_lines(tmp_path):
    noise = '[2026-05-07 19:20:00] INFO:     127.0.0.1:5555 - "POST /generate HTTP/1.1" 200\n'
    path = tmp_path / "engine-gpu0.log"
    compute = (SNAPSHOTS / "compute_flat" / "engine.log").read_text()
    path.write_text((BASELINE / "engine.log").read_text() + compute + noise * 2000)
    text = read_log(path)
    assert "max_mamba_cache_size: 80" not in text and "max_mamba_cache_size: 200" in text
    assert "POST /generate" not in text
    facts = parse_log(text)
    assert facts.scheduler is not None and facts.scheduler.max_running_requests == 40
    assert len(facts.decode_lines()) == 3
    # Each earlier start is kept as its scheduler line and decode lines: what measured the
    # engine at that start's cap (the baseline's 16, then the canary's 24 and 32).
    starts = [parse_log(chunk) for chunk in log_starts(text)]
    assert [f.scheduler.max_running_requests for f in starts if f.scheduler] == [16, 24, 32, 40]
    assert [len(f.decode_lines()) for f in starts] == [5, 3, 3, 3]
    assert starts[0].mamba is None  # an earlier start's pools are not kept
