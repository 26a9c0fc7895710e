"""The README's path and ``make demo`` pass ``verify`` with the default quality gates on the
simulator at its own output lengths (docs/workload.md): the demo's 300 chat prompts (thinking
rows, some cut at the context limit inside their reasoning) and 300 plain prompts, enqueued
as the README and producer/demo.py do, with no gate or token cap set.
"""

from __future__ import annotations

import orjson
import pytest

from config.settings import SimSettings
from producer import demo
from tests.conftest import run_producer, wait_done, write_prompts


@pytest.mark.parametrize("prompts", ["demo", "plain"])
def test_the_readme_path_and_the_demo_pass_verify_with_the_default_gates(
        prompts, fleet_env, make_workers, tmp_path, monkeypatch):
    # The demo's settings (producer/demo.py): no gates, the sim's own lengths and seed.
    env = {k: v for k, v in fleet_env.items()
           if k not in ("FLEET_QUALITY", "FLEET_SIM_MEAN_OUTPUT_TOKENS", "FLEET_SIM_SEED")}
    sim = SimSettings.model_fields  # the workers get fleet_env's short lengths unless told
    make_workers([0], FLEET_SIM_SPEED="25",
                 FLEET_SIM_MEAN_OUTPUT_TOKENS=str(sim["mean_output_tokens"].default),
                 FLEET_SIM_SEED=str(sim["seed"].default or 0))
    if prompts == "demo":
        monkeypatch.setattr(demo, "DEMO_DIR", tmp_path)
        src = demo._prompts(tmp_path / "prompts.jsonl")
        args = demo.ENQUEUE_ARGS
    else:
        src, args = write_prompts(tmp_path / "p.jsonl", demo.N_PROMPTS), ()
    assert run_producer(env, "enqueue", str(src), "--job", "dflt", *args).returncode == 0
    wait_done(env, "dflt", 240)
    res = run_producer(env, "verify", "--job", "dflt", "--json")
    report = orjson.loads(res.stdout)
    assert res.returncode == 0, report["quality"]["failed"]
    assert report["quality"]["thresholds"]["near_empty"] == 0.01  # the defaults were in force
    if prompts == "demo":  # thinking rows, a few cut inside their reasoning: truncated alone
        assert report["truncated"] > 0 and report["quality"]["thinking_rows"] > 250
        assert report["quality"]["figures"]["near_empty"]["count"] <= 3
