"""A live engine answering HTTP 500 to one prompt: that prompt fails after a few tries, the rest
of the batch completes, and the engine is never treated as down."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis

from tests.conftest import run_producer, wait_done
from tests.simproc import Sim, launch
from workers.engine.client import EngineClient, Sampling
from workers.errors import PromptFailed


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Sim]:
    """A fast dense-model simulator."""
    proc = launch(tmp_path, ["--model-path", "Qwen/Qwen3-0.6B", "--context-length", "4096"],
                  {"FLEET_SIM_SPEED": "1000", "FLEET_SIM_MEAN_OUTPUT_TOKENS": "20"})
    proc.wait_ready()
    yield proc
    proc.stop()


def test_client_reads_a_500_as_a_failed_prompt(sim: Sim) -> None:
    async def go() -> None:
        client = EngineClient(sim.url, 30.0, 4)
        try:
            with pytest.raises(PromptFailed, match="HTTP 500"):
                await client.complete("hi", None, Sampling(max_new_tokens=4, extra={"seed": 1}))
            assert await client.healthy()
        finally:
            await client.aclose()

    asyncio.run(go())


def test_500_from_a_healthy_engine_fails_the_prompt_after_a_few_tries(
        fleet_env, make_workers, tmp_path: Path, r: redis.Redis) -> None:
    (worker,) = make_workers([0], FLEET_RETRY_MAX_ATTEMPTS="10", FLEET_RETRY_BASE_S="0.05")
    rows = [{"id": f"q{i}", "prompt": f"fine {i}"} for i in range(6)]
    rows[2]["prompt"] = "this one hits __SIM_ERROR__ in the server"
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in rows))
    assert run_producer(fleet_env, "enqueue", str(path), "--job", "e500").returncode == 0
    st = wait_done(fleet_env, "e500", timeout_s=120)
    assert (st["completed"], st["failed"]) == (5, 1)
    store = Path(fleet_env["FLEET_STORE_URL"].removeprefix("file://"))
    out = [orjson.loads(x) for f in sorted((store / "jobs/e500/results").glob("*.jsonl"))
           for x in f.read_bytes().splitlines()]
    failed = [x for x in out if x["status"] == "failed"]
    assert len(failed) == 1 and "gave up after 3 attempts" in failed[0]["error"]
    assert "HTTP 500" in failed[0]["error"]
    assert "restart" not in worker.log_path.read_text().lower()


def test_openai_batch_bodies_with_seed_user_logprobs_run_to_ok(
        fleet_env, make_workers, tmp_path: Path, r: redis.Redis) -> None:
    make_workers([0], FLEET_SIM_SPEED="50")
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}],
                      "max_tokens": 8, "seed": i, "user": "u1", "logprobs": False}}
            for i in range(4)]
    path = tmp_path / "batch.jsonl"
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in rows))
    assert run_producer(fleet_env, "enqueue", str(path), "--job", "oai").returncode == 0
    st = wait_done(fleet_env, "oai", timeout_s=120)
    assert (st["completed"], st["failed"]) == (4, 0)
