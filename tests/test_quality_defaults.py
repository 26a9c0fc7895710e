"""The README's path and ``make demo`` pass ``verify`` with the default quality gates on the
simulator at its own output lengths (docs/workload.md): the demo's 300 chat prompts (thinking
rows, some cut at the context limit inside their reasoning) and 300 plain prompts, enqueued
as the README and producer/demo.py do, with no gate or token cap set.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from config.settings import SimSettings
from producer import demo
from tests.conftest import run_producer, wait_done, write_prompts
from workers.dataset.jobs import decode_rows, result_key
from workers.dataset.store import LocalStore


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


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in rows))
    return path


def test_tool_call_and_structured_rows_pass_by_their_form_and_a_regex_the_sim_ignores_fails(
        fleet_env, make_workers, tmp_path, r):
    """A tools job (the engine's tool-call parser on) and an extraction job, with the default
    gates: the tool-call rows (empty content) and the short JSON answers are judged by their
    form and pass. The sim does not make its text match a regex (workers/sim/structured.py),
    so a job asking for one is flagged ``invalid``, as it would be on an engine that ignored
    the grammar."""
    env = {k: v for k, v in fleet_env.items() if k != "FLEET_QUALITY"}
    env["FLEET_PROFILE"] = "qwen36-27b-tools"
    sim = SimSettings.model_fields
    make_workers([0], FLEET_PROFILE="qwen36-27b-tools", FLEET_SIM_SPEED="25",
                 FLEET_SIM_MEAN_OUTPUT_TOKENS=str(sim["mean_output_tokens"].default))
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                              "properties": {"city": {"type": "string"}}}}}]
    schema = {"type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    rows = [{"id": f"t{i}", "messages": [{"role": "user", "content": f"weather in city {i}?"}],
             "tools": tools, "tool_choice": "required" if i % 2 else "auto"} for i in range(40)]
    rows += [{"id": f"j{i}", "messages": [{"role": "user", "content": f"who is person {i}?"}],
              "response_format": {"type": "json_schema",
                                  "json_schema": {"name": "p", "schema": schema}}}
             for i in range(40)]
    src = _jsonl(tmp_path / "mixed.jsonl", rows)
    assert run_producer(env, "enqueue", str(src), "--job", "forms", "--batch-size",
                        "20").returncode == 0
    wait_done(env, "forms", 240)
    res = run_producer(env, "verify", "--job", "forms", "--json")
    report = orjson.loads(res.stdout)
    q = report["quality"]
    calls = sum(1 for b in range(4) for x in _results(env, "forms", b) if x.get("tool_calls"))
    assert calls >= 20  # every "required" row, about half of the "auto" ones
    assert q["formed"] >= calls + 40 - report["truncated"]
    assert res.returncode == 0, q["failed"]
    assert q["figures"]["invalid"]["count"] == 0 and q["figures"]["near_empty"]["count"] <= 1

    regex = _jsonl(tmp_path / "regex.jsonl", [
        {"id": f"d{i}", "prompt": f"the date of event {i}", "regex": r"\d{4}-\d{2}-\d{2}"}
        for i in range(20)])
    assert run_producer(env, "enqueue", str(regex), "--job", "dates").returncode == 0
    wait_done(env, "dates", 240)
    res = run_producer(env, "verify", "--job", "dates", "--json")
    q = orjson.loads(res.stdout)["quality"]
    assert res.returncode == 5 and q["gates_failed"] == ["invalid"]
    assert q["figures"]["invalid"]["count"] == q["formed"] > 0


def _results(env: dict[str, str], job: str, batch: int) -> list[dict]:
    store = LocalStore(Path(env["FLEET_STORE_URL"].removeprefix("file://")))
    return decode_rows(store.get(result_key(job, batch)))
