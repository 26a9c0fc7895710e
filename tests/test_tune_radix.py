"""The no-radix lever needs the engine's own cache-hit evidence (issue #13, finding 7)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.simproc import Sim, launch
from workers.tune import snapshot
from workers.tune.diagnose import diagnose
from workers.tune.levers import NO_RADIX_MAX_HIT_RATE
from workers.tune.readings import read_snapshot

SNAPSHOTS = Path(__file__).parent / "fixtures" / "tune" / "snapshots"
SYSTEM = "You are a careful assistant who answers in one short paragraph. " * 20


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Sim]:
    """A fast dense-model simulator with metrics."""
    proc = launch(tmp_path, ["--model-path", "Qwen/Qwen3-0.6B", "--context-length", "4096",
                             "--enable-metrics"],
                  {"FLEET_SIM_SPEED": "1000", "FLEET_SIM_MEAN_OUTPUT_TOKENS": "20"})
    proc.wait_ready()
    yield proc
    proc.stop()


def _hit_rate(sim: Sim, prompts: list[str]) -> float:
    async def send() -> None:
        async with httpx.AsyncClient(timeout=60.0) as client:
            for p in prompts:  # one by one: each prompt finds the previous ones cached
                body = {"text": p, "sampling_params": {"max_new_tokens": 4}}
                assert (await client.post(f"{sim.url}/generate", json=body)).status_code == 200

    asyncio.run(send())
    return read_snapshot({"metrics": sim.get("/metrics").text}).get("cache_hit_rate")


def test_sim_shows_a_shared_system_prompt_in_its_cache_hit_figures(sim: Sim) -> None:
    shared = _hit_rate(sim, [f"{SYSTEM}Question {i}: why?" for i in range(8)])
    assert shared > NO_RADIX_MAX_HIT_RATE


def test_sim_shows_unrelated_prompts_share_nothing(sim: Sim) -> None:
    unique = _hit_rate(sim, [f"{i:04d} unrelated prompt " * 30 for i in range(8)])
    assert unique < NO_RADIX_MAX_HIT_RATE


def _with_hit_rate(rate: float) -> dict:
    snap = snapshot.load(SNAPSHOTS / "baseline_mamba_slots")
    prompt = float(re.search(r"^sglang:prompt_tokens_total\{[^}]*\} (\S+)$", snap["metrics"],
                             re.M).group(1))
    snap["metrics"] = re.sub(r'(cached_tokens_total\{[^}]*cache_source="device"\}) \S+',
                             lambda m: f"{m.group(1)} {prompt * rate}", snap["metrics"])
    return snap


def test_no_radix_is_chosen_with_its_prefill_cost_only_when_prompts_share_little() -> None:
    little = diagnose(_with_hit_rate(0.02)).to_json()["recommendation"]
    assert little["chosen"] == "no_radix"
    reason = next(r for r in little["reasons"] if r.startswith("--disable-radix-cache"))
    assert "prefilled again" in reason and "less throughput" in reason
    shared = diagnose(_with_hit_rate(0.6)).to_json()["recommendation"]
    assert not shared["chosen"].startswith("no_radix")
    no_radix = next(o for o in shared["options"] if o["name"] == "no_radix")
    assert not no_radix["eligible"] and "share prefixes" in no_radix["note"]


def test_samples_count_as_running_requests_and_block_the_no_radix_lever() -> None:
    """A job of N samples per prompt: without the radix cache each sample prefills its prompt
    again, so the lever that was chosen at a 2 % hit rate is not, and its cost counts the
    repeated prefill; the worker's supply counts every sample as a running request."""
    snap = _with_hit_rate(0.02)
    snap["job"] = {**(snap.get("job") or {}), "name": "s", "samples_per_prompt": 8}
    rec = diagnose(snap).to_json()["recommendation"]
    assert not rec["chosen"].startswith("no_radix")
    no_radix = next(o for o in rec["options"] if o["name"] == "no_radix")
    assert not no_radix["eligible"] and "samples each prompt 8 times" in no_radix["note"]
    from workers.tune.levers import Situation

    sit = Situation({}, 16, 8192, None, 0.02, 0.1, 0.8, 0.0, None,  # type: ignore[arg-type]
                    samples_per_prompt=8)
    assert sit.no_radix_cost() == pytest.approx(0.7)  # 7 more prefills of a 10 % share
    one = Situation({}, 16, 8192, None, 0.02, 0.1, 0.8, 0.0, None)  # type: ignore[arg-type]
    assert one.no_radix_cost() == pytest.approx(0.002)
