"""The seed's disaster against a real worker and the simulator: near-empty answers finishing
with ``stop`` are caught by ``status`` within the first 500 rows, and by ``verify``."""

from __future__ import annotations

import orjson
import pytest

from tests.conftest import follow_status, run_producer, wait_done, write_prompts


def test_near_empty_answers_warn_early_and_fail_verify(fleet_env, make_workers, tmp_path, r):
    env = {**fleet_env, "FLEET_QUALITY": ""}  # the default gates (conftest turns them off)
    make_workers([0], FLEET_SIM_ANSWER="near-empty", FLEET_QUALITY="")
    prompts = write_prompts(tmp_path / "p.jsonl", 3000)
    res = run_producer(env, "enqueue", str(prompts), "--job", "seed", "--batch-size", "500")
    assert res.returncode == 0, res.stderr
    st = follow_status(env, "seed", lambda st: st["quality"]["warning"] or st["done"], 120)
    assert st["quality"]["warning"] and "near_empty" in st["quality"]["warning"], st["quality"]
    logs = "".join(p.read_text() for p in (tmp_path / "logs").rglob("*.log"))
    line = next(x for x in logs.splitlines() if "quality warning: job seed" in x)
    first = int(line.split("first ")[1].split(" rows")[0])
    assert 200 <= first <= 500, line  # caught within the first 500 rows
    assert "near_empty 100.0 %" in line
    wait_done(env, "seed", timeout_s=180)
    res = run_producer(env, "verify", "--job", "seed", "--json")
    report = orjson.loads(res.stdout)
    assert res.returncode == 5 and report["ok"], res.stderr
    assert report["quality"]["gates_failed"] == ["near_empty"]
    assert "quality gate failed: near_empty 100.0 %" in res.stderr


def _chat_prompts(path, n: int):
    path.write_bytes(b"".join(orjson.dumps(
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]}) + b"\n"
        for i in range(n)))
    return path


@pytest.mark.parametrize(("answer", "gates"), [
    ("no-reasoning", ["no_reasoning"]),
    ("markers", ["no_reasoning", "markers"]),
    ("normal", []),
])
def test_thinking_mode_gates_against_the_sim(fleet_env, make_workers, tmp_path, r, answer,
                                              gates):
    env = {**fleet_env, "FLEET_QUALITY": ""}
    # Answers long enough that the reasoning (80 % of a draw) leaves some answer after it.
    make_workers([0], FLEET_SIM_ANSWER=answer, FLEET_QUALITY="", FLEET_SIM_MEAN_OUTPUT_TOKENS="300")
    job = f"think-{answer}"
    res = run_producer(env, "enqueue", str(_chat_prompts(tmp_path / "c.jsonl", 200)), "--job",
                       job, "--batch-size", "100", "--quality", "near_empty_tokens=1")
    assert res.returncode == 0, res.stderr
    wait_done(env, job, timeout_s=120)
    res = run_producer(env, "verify", "--job", job, "--json")
    report = orjson.loads(res.stdout)
    quality = report["quality"]
    assert quality["thinking_rows"] == 200, quality
    assert quality["gates_failed"] == gates, quality["failed"]
    assert res.returncode == (5 if gates else 0)
