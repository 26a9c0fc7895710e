"""The GPU's in-flight budget, shared by its batches oldest first
(workers/delivery/gpu_share.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import orjson
import redis.asyncio as aioredis

from tests.conftest import run_producer, wait_done, write_prompts
from workers.batch.limiter import Limiter
from workers.delivery.gpu_share import STALE_S, Claim, GpuShare, allowed, in_flight_total
from workers.redisdb.keys import NodeKeys


def _claim(tag: str, started: float, claim: int, at: float = 100.0, in_flight: int = 0) -> Claim:
    return Claim(tag, started, claim, in_flight, at)


def test_oldest_batch_gets_the_budget_and_younger_ones_what_it_does_not_claim():
    old, young = _claim("j/0", 1.0, 200), _claim("j/1", 2.0, 200)
    both = [old, young]
    assert allowed(old, both, 51, 100.0) == 51
    assert allowed(young, both, 51, 100.0) == 0
    tail = _claim("j/0", 1.0, 12)  # the older batch is down to its last 12 prompts
    assert allowed(young, [tail, young], 51, 100.0) == 39
    third = _claim("j/2", 3.0, 200)
    assert allowed(third, [tail, young, third], 51, 100.0) == 0
    assert allowed(young, [young], 51, 100.0) == 51


def test_stale_claims_are_ignored_and_ties_are_broken_by_tag():
    dead = _claim("j/0", 1.0, 200, at=100.0 - STALE_S - 0.1)
    young = _claim("j/1", 2.0, 200)
    assert allowed(young, [dead, young], 51, 100.0) == 51
    a, b = _claim("j/a", 5.0, 30), _claim("j/b", 5.0, 30)
    assert (allowed(a, [a, b], 40, 100.0), allowed(b, [a, b], 40, 100.0)) == (40, 10)


def test_heartbeat_total_counts_live_claims_only():
    raw = {b"j/0": _claim("j/0", 1.0, 9, at=99.0, in_flight=7).encode(),
           b"j/1": _claim("j/1", 2.0, 9, at=90.0, in_flight=5).encode(),
           b"junk": b"3"}
    assert in_flight_total(raw, 100.0) == 7


def test_claims_are_exchanged_through_redis(redis_server):
    async def scenario() -> list[int]:
        client = aioredis.from_url(redis_server.url)
        try:
            await client.flushall()
            older = GpuShare(client, "gpu0@share", "j/0")
            younger = GpuShare(client, "gpu0@share", "j/1")
            younger.started = older.started + 1
            got = [await older.exchange(200, 0, 51), await younger.exchange(200, 0, 51)]
            got.append(await older.exchange(20, 20, 51))  # the older batch's tail
            got.append(await younger.exchange(180, 31, 51))
            await older.leave()
            got.append(await younger.exchange(150, 51, 51))
            return got
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == [51, 0, 51, 31, 51]


class _Sampler(threading.Thread):
    """Samples the engine's queue and the node's claims until stopped."""

    def __init__(self, url: str, r, node_key: str) -> None:
        super().__init__(daemon=True)
        self.url, self.r, self.node_key = url, r, node_key
        self.engine: list[int] = []
        self.claims: list[list[dict]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self.stop.is_set():
                try:
                    load = client.get(f"{self.url}/v1/loads").json()["loads"][0]
                except httpx.HTTPError:
                    continue
                total = load["num_running_reqs"] + load["num_waiting_reqs"]
                if total:
                    self.engine.append(total)
                self.claims.append([orjson.loads(v) for v in self.r.hvals(self.node_key)])
                time.sleep(0.02)


def test_two_batches_on_a_gpu_keep_one_budget_in_flight_and_overlap_tails(
        fleet_env, make_workers, tmp_path, r):
    budget = 6
    (worker,) = make_workers([0], FLEET_CLIENT_CONCURRENCY=str(budget), FLEET_SIM_SPEED="1",
                             FLEET_BATCHES_PER_GPU="2")
    url = f"http://127.0.0.1:{int(fleet_env['FLEET_ENGINE_BASE_PORT'])}"
    sampler = _Sampler(url, r, NodeKeys(worker.node).in_flight)
    sampler.start()
    prompts = write_prompts(tmp_path / "prompts.jsonl", 160)
    res = run_producer(fleet_env, "enqueue", str(prompts), "--job", "share", "--batch-size",
                       "40", "--max-new-tokens", "200")
    assert res.returncode == 0, res.stderr
    st = wait_done(fleet_env, "share")
    sampler.stop.set()
    sampler.join()
    assert st["completed"] == 160
    # Two batches ran side by side; both had requests out at once (the older one's tail).
    assert any(len(c) == 2 for c in sampler.claims)
    assert any(len(c) == 2 and all(x["in_flight"] for x in c) for c in sampler.claims)
    # Without the shared budget each batch keeps 6 out and the engine holds 12 most of the time.
    # A finished request stays in the engine's running batch until the scheduler filters it,
    # one or two iterations after its answer went out (docs/simulator.md), while its slot's
    # next request already waits: the engine counts up to two of those on top of the budget.
    over = sum(t > budget + 2 for t in sampler.engine)
    assert len(sampler.engine) > 50
    assert over <= 0.05 * len(sampler.engine), sorted(sampler.engine)[-20:]


def test_limiter_holds_at_zero_and_admits_as_many_as_the_new_limit():
    async def scenario() -> list[int]:
        limiter = Limiter(0)
        inside: list[int] = []
        release = asyncio.Event()

        async def one(i: int) -> None:
            async with limiter:
                inside.append(i)
                await release.wait()

        tasks = [asyncio.ensure_future(one(i)) for i in range(10)]
        seen = []
        for limit in (0, 3, 1, 5):  # lowering never preempts; raising admits up to the limit
            await limiter.set_limit(limit)
            await asyncio.sleep(0.01)
            seen.append(len(inside))
        release.set()
        await asyncio.gather(*tasks)
        seen.append(len(inside))
        return seen

    assert asyncio.run(scenario()) == [0, 3, 3, 5, 10]
