"""``tune snapshot`` against a real simulated engine (HTTP, log file), then ``diagnose`` on it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from config.launch_profile import load_profile
from producer.localfleet import free_port
from tests.conftest import ROOT, run_tune
from tests.simproc import launch


@pytest.fixture()
def sim_engine(tmp_path: Path, redis_server) -> Iterator[dict[str, str]]:
    """A simulated engine for GPU 0 on the baseline profile, as a worker would start it."""
    port = free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(
        FLEET_SIM_STARTUP_S="0.1",
        FLEET_ENGINE="sim",
        FLEET_ENGINE_BASE_PORT=str(port),
        FLEET_LOG_DIR=str(logs),
        FLEET_REDIS_URL=redis_server.url,
        PYTHONPATH=str(ROOT),
    )
    argv = load_profile("qwen36-27b-baseline").to_argv()
    sim = launch(logs, argv, {**env, "SGLANG_ENABLE_SPEC_V2": "1"}, port=port,
                 log_name="engine-gpu0.log")
    sim.wait_ready()
    yield env
    sim.stop()


def test_snapshot_of_a_live_engine_then_diagnose_it(sim_engine, tmp_path):
    out = tmp_path / "snap.json"
    res = run_tune(sim_engine, "snapshot", "--gpu", "0", "--out", str(out))
    assert res.returncode == 0, res.stderr
    snap = json.loads(out.read_text())
    assert snap["server_info"]["internal_states"][0]["effective_max_running_requests_per_dp"] == 16
    assert snap["loads"]["loads"][0]["max_running_requests"] == 16
    assert "sglang:num_running_reqs" in snap["metrics"]
    assert "Mamba Cache is allocated. max_mamba_cache_size: 80" in snap["log"]
    assert isinstance(snap["captured_at"], float)
    # No GPU on a CI machine and no worker heartbeat: absent, each with its reason.
    assert "gpu" not in snap and "NVML" in snap["unavailable"]["gpu"]
    assert "client" in snap["unavailable"]
    res = run_tune(sim_engine, "diagnose", "--snapshot", str(out), "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    # Idle engine: nothing queued and nothing running, so the client is the limit.
    assert d["binding_constraint"] == "client_concurrency"
    # Calibrated from the engine's own log, the model gives back the engine's numbers.
    current = d["memory_model"]["current"]
    assert current["max_running_requests"] == 16 and current["mamba_slots"] == 80
    assert current["kv_tokens"] == snap["server_info"]["max_total_num_tokens"]
