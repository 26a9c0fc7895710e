"""Every SGLang release from 0.5.10.post1 to 0.5.23: the readers parse the formats rendered from
each release's own wheel (tests/fixtures/sglang/<version>/formats/, written by
render_from_wheels.py), the trait table agrees with those formats, and the simulator writes
them (issue #21, item 3)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from workers.engine.client import effective_cap
from workers.engine.log import parse_log
from workers.engine.metrics import FLEET_METRICS, parse_metrics
from workers.engine.releases import (
    ARITHMETIC,
    KNOWN,
    NEWEST,
    RENAMED_0_5_20,
    engine_flags,
    source,
    status,
    traits,
    unknown_traits,
)
from workers.sim.formats import graph_lines, kv_line, shape_loads, shape_server_info

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
NUMBER = re.compile(r"\d+(?:\.\d+)?")
# The order SGLang prints the start-up lines in (model_runner.py, then the scheduler).
STARTUP = ("load_begin", "load_end", "mamba", "kv", "pool_end", "graph_end", "scheduler",
           "prefill", "decode")


def formats(version: str, name: str) -> dict:
    return json.loads((FIXTURES / version / "formats" / f"{name}.json").read_text())


def as_log(lines: dict[str, str | None]) -> str:
    return "\n".join(f"[2026-12-01 09:00:{i:02d}] {lines[k]}" for i, k in enumerate(STARTUP)
                     if lines[k] is not None)


def shape(line: str) -> str:
    """A line with its numbers replaced, to compare formats rather than values."""
    return NUMBER.sub("N", line)


@pytest.mark.parametrize("version", KNOWN)
def test_each_release_s_log_lines_are_read_in_full(version: str) -> None:
    lines = formats(version, "lines")
    assert all(lines[k] for k in STARTUP), f"{version}: a line was not found in its wheel"
    log = parse_log(as_log(lines))
    assert log.unread == []
    assert log.weights_begin_avail_gib == 139.13 and log.weights_gib == 50.89
    assert log.mamba is not None and log.mamba.slots == 80 and log.mamba.ssm_gib == 11.81
    assert log.kv_tokens == 429581 and log.kv_gib == pytest.approx(13.1)
    assert log.graph_gib == 1.2 and log.graph_end_avail_gib == 10.52
    assert log.scheduler is not None and log.scheduler.max_running_requests == 16
    prefill, decode = log.batches
    assert prefill.number("#new-token") == 1024 and prefill.number("input throughput "
                                                                   "(token/s)") == 5123.4
    assert decode.number("#running-req") == 4
    assert decode.number("gen throughput (token/s)") == 812.55
    assert (prefill.number("#pending-token") is not None) == traits(version).prefill_pending_token


@pytest.mark.parametrize("version", KNOWN)
def test_the_trait_table_agrees_with_each_wheel(version: str) -> None:
    t, lines = traits(version), formats(version, "lines")
    metrics, http = formats(version, "metrics"), formats(version, "http")
    assert t.kv_line_dtype == ("dtype: " in lines["kv"])
    assert (t.graph_line == "legacy") == lines["graph_end"].startswith("Capture cuda graph end")
    assert (t.graph_line == "named_bs_end") == (" end. bs=" in lines["graph_end"])
    assert t.prefill_pending_token == ("#pending-token" in lines["prefill"])
    assert t.metric_context_len == ("sglang:context_len" in metrics)
    assert t.metric_is_streaming == ("is_streaming" in metrics["sglang:prompt_tokens_total"])
    assert t.loads_aggregate == ("aggregate" in http["v1_loads"])
    assert t.loads_accelerator == ("accelerator" in http["v1_loads"])
    assert (t.memory_usage_graph == "by_phase") == ("startup_available" in http["memory_usage"])


@pytest.mark.parametrize("version", KNOWN)
def test_each_release_exports_what_the_fleet_reads(version: str) -> None:
    metrics = formats(version, "metrics")
    missing = [m for m in FLEET_METRICS if f"sglang:{m}" not in metrics]
    assert missing == []
    # From 0.5.17 a finished request counts under is_streaming="true" or "false": both add up.
    series = [("false", 3.0), ("true", 2.0)]
    if "is_streaming" not in metrics["sglang:num_requests_total"]:
        series = [("", 5.0)]
    text = "\n".join(
        "sglang:num_requests_total{model_name=\"m\",engine_type=\"unified\""
        + (f",is_streaming=\"{s}\"" if s else "") + f"}} {n}" for s, n in series
    )
    assert parse_metrics(text).total("num_requests_total") == 5.0


@pytest.mark.parametrize("version", KNOWN)
def test_the_effective_cap_is_read_from_each_release_s_fields(version: str) -> None:
    http = formats(version, "http")
    assert "max_running_requests" in http["v1_loads_rank"] and "loads" in http["v1_loads"]
    rank = {key: 0 for key in http["v1_loads_rank"]}
    assert effective_cap({"loads": [{**rank, "max_running_requests": 16}]}, None) == 16
    info = {"internal_states": [{"effective_max_running_requests_per_dp": 40}]}
    assert effective_cap({"loads": [rank]}, info) == 40


@pytest.mark.parametrize("version", KNOWN)
def test_the_sim_writes_each_release_s_lines(version: str) -> None:
    t, lines = traits(version), formats(version, "lines")
    assert shape(kv_line(t, 429581, 6.55, 6.55, "auto")) == shape(lines["kv"])
    _, end = graph_lines(t, 4, [1, 2, 4, 8, 16], 11.72, 1.2, 12.0)
    assert shape(end) == shape(lines["graph_end"])


@pytest.mark.parametrize("version", KNOWN)
def test_the_sim_answers_in_each_release_s_fields(version: str) -> None:
    t, http = traits(version), formats(version, "http")
    rank = {"num_running_reqs": 0, "num_waiting_reqs": 0, "max_running_requests": 16,
            "num_total_reqs": 0}
    doc = shape_loads({"timestamp": "t", "version": version, "dp_rank_count": 1,
                       "loads": [rank], "aggregate": {}}, t)
    assert sorted(doc) == sorted(http["v1_loads"])
    assert set(doc["loads"][0]) <= set(http["v1_loads_rank"])
    usage = {"weight": 50.9, "kvcache": 13.1, "token_capacity": 429581, "graph": 1.2}
    info = shape_server_info({"internal_states": [{"memory_usage": usage}]}, t, True, 0.0)
    assert sorted(info["internal_states"][0]["memory_usage"]) == sorted(http["memory_usage"])


def test_a_newer_release_is_read_as_the_newest_and_its_assumptions_listed() -> None:
    assert [status(v) for v in ("0.5.23", "0.5.24", "0.5.16.dev0", "0.5.9", None)] == [
        "known", "newer", "between", "older", "invalid"]
    assert unknown_traits(NEWEST) == []
    assumed = unknown_traits("0.5.24")
    assert len(assumed) == len(ARITHMETIC) and all("0.5.24" in a and NEWEST in a
                                                   for a in assumed)
    assert traits("0.5.24").graph_line == traits(NEWEST).graph_line
    assert unknown_traits("0.5.9") and "not a release" in unknown_traits("0.5.9")[0]
    with pytest.raises(ValueError):
        traits("0.5.9")


def test_each_trait_names_the_file_it_was_read_from() -> None:
    assert source("explicit_cap_rule", "0.5.13").startswith("0.5.10.post1")
    assert source("explicit_cap_rule", "0.5.14") == (
        "0.5.14 model_executor/model_runner_kv_cache_mixin.py::_resolve_max_num_reqs")
    assert source("kv_configurator", "0.5.23").endswith("mem_cache/kv_cache_configurator.py"
                                                        "::KVCacheConfigurator")


def test_flags_a_release_no_longer_takes_are_renamed() -> None:
    flags = {"mamba-scheduler-strategy": "extra_buffer", "disable-piecewise-cuda-graph": True,
             "cuda-graph-max-bs": 64, "tp-size": 1}
    assert engine_flags("0.5.19", flags) == flags
    assert engine_flags("0.5.20", flags) == {
        "mamba-radix-cache-strategy": "extra_buffer", "cuda-graph-backend-prefill": "disabled",
        "cuda-graph-max-bs-decode": 64, "tp-size": 1}


@pytest.mark.parametrize("old", sorted(RENAMED_0_5_20))
def test_the_engine_is_launched_with_the_installed_releases_flag_names(old: str) -> None:
    """Every flag 0.5.20 renamed reaches a 0.5.20+ engine under its new name, and 0.5.11 keeps
    the old one (the argv a worker spawns, not only the rename table)."""
    from unittest import mock

    from config.launch_profile import LaunchProfile
    from workers.engine import lifecycle

    value: object = True if old.startswith(("disable", "enforce")) else 64
    profile = LaunchProfile(name="p", flags={"model-path": "m", old: value})
    spec = lifecycle.EngineSpec(kind="sglang", profile=profile, gpu=0, host="127.0.0.1",
                                port=1, log_path=Path("/tmp/unused.log"))
    new = RENAMED_0_5_20[old].partition("=")[0]
    for version, present, absent in (("0.5.23", new, old), ("0.5.11", old, new)):
        with mock.patch.object(lifecycle, "installed_version", return_value=version):
            argv = spec.argv()
        assert f"--{present}" in argv and f"--{absent}" not in argv, (version, argv)
