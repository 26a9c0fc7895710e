"""Delivery rules against a real redis-server, one rule at a time: fencing tokens, counters that
follow the store, the lease's renewal rules and watchdog, the GPU's isolation turn, the engine
guard, and kombu's Redis layout that the lease leans on."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from config.launch_profile import load_profile
from producer.localfleet import free_port
from workers.dataset.jobs import encode_rows, result_key
from workers.dataset.samples import parse_unit_key
from workers.dataset.store import open_store
from workers.delivery import jobstate, lease, ownership, whereabouts
from workers.delivery.gpu_share import Claim, allowed, others_in_flight
from workers.delivery.intake import Intake
from workers.delivery.ownership import LostOwnership, Ownership
from workers.delivery.progress import BatchEnv, ProgressRecorder, read_progress
from workers.engine.lifecycle import Engine, EngineSpec
from workers.node.context import WorkerIdentity
from workers.redisdb import scripts
from workers.redisdb.keys import JobKeys


def _row(job: str, batch: int, index: int, status: str = "ok") -> dict:
    return {"job": job, "batch": batch, "index": index, "id": f"p{index}", "prompt": "q",
            "messages": None, "completion": "a" if status == "ok" else None, "reasoning": None,
            "finish_reason": "stop" if status == "ok" else None, "prompt_tokens": 1,
            "completion_tokens": 3 if status == "ok" else 0, "latency_s": 0.1,
            "status": status, "error": None if status == "ok" else "boom",
            "profile": "p", "gpu": 0, "node": "n"}


def _record(r: redis.Redis, job: str, batch: int, token: str, rows: list[dict]) -> int:
    return int(scripts.record_rows(r, job, batch, "n", token, [
        (x["index"], orjson.dumps(x), "ok" if x["status"] == "ok" else "failed",
         x["completion_tokens"]) for x in rows]))


def _owned_recorder(r: redis.Redis, ar: aioredis.Redis, store, job: str) -> ProgressRecorder:
    """A recorder for batch 0 of ``job`` whose run owns the batch, with rows 0-2 buffered."""
    env = BatchEnv(settings=None, me=WorkerIdentity(node="n", host="h", gpu=0, port=1),  # type: ignore[arg-type]
                   store=store, redis=ar, profile="p")
    r.set(JobKeys(job).owner(0), "tok")
    rec = ProgressRecorder(env, job, 0, "tok")
    for i in range(3):
        rec.add(_row(job, 0, i))
    return rec


def test_a_run_that_lost_its_batch_can_neither_record_nor_finish(r: redis.Redis) -> None:
    async def scenario() -> None:
        ar = aioredis.Redis(connection_pool=aioredis.ConnectionPool.from_url(
            f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}/0"))
        first = Ownership(ar, "f", 3, "gpu0@a", ttl_s=30)
        assert (await first.acquire(lambda: _false(), 0)).status == "ok"
        assert _record(r, "f", 3, first.token, [_row("f", 3, 0)]) == 1
        r.delete(JobKeys("f").owner(3))  # its claim lapsed (a frozen VM)
        second = Ownership(ar, "f", 3, "gpu1@b", ttl_s=30)
        assert (await second.acquire(lambda: _false(), 0)).status == "ok"
        # The first run's progress write and finish step are refused; the second's are not.
        assert _record(r, "f", 3, first.token, [_row("f", 3, 1)]) == -1
        assert not await first.renew() and not await first.still_owned()
        assert scripts.finish_batch(r, "f", 3, first.token) == 0
        assert _record(r, "f", 3, second.token, [_row("f", 3, 1)]) == 1
        assert scripts.finish_batch(r, "f", 3, second.token) == 1
        assert jobstate.counters(r, "f")["completed"] == 2
        await ar.aclose()

    asyncio.run(scenario())


async def _false() -> bool:
    return False


def test_a_run_past_its_lease_confirms_its_claim_before_it_sends_again(r: redis.Redis) -> None:
    """A run frozen past its lease (its keeper has not run yet) must not send on a claim that
    another run took meanwhile; within the lease it sends without asking Redis."""
    async def scenario() -> None:
        ar = aioredis.from_url(f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}")
        first = Ownership(ar, "z", 1, "gpu0@a", ttl_s=2)
        assert (await first.acquire(_false, 0)).status == "ok"
        r.set(JobKeys("z").owner(1), "gpu1@b|other")  # taken over while it was frozen
        await first.confirm(margin_s=0.5)  # fresh claim: trusted without a round trip
        await asyncio.sleep(1.6)  # past ttl - margin: the claim may have lapsed
        with pytest.raises(LostOwnership):
            await first.confirm(margin_s=0.5)
        second = Ownership(ar, "z", 2, "gpu0@a", ttl_s=2)
        assert (await second.acquire(_false, 0)).status == "ok"
        await asyncio.sleep(1.6)
        await second.confirm(margin_s=0.5)  # still its own: renewed, then trusted again
        assert r.pttl(JobKeys("z").owner(2)) > 1500
        await ar.aclose()

    asyncio.run(scenario())


def test_a_second_delivery_waits_for_a_live_holder_and_then_gives_up(r: redis.Redis) -> None:
    async def scenario() -> None:
        ar = aioredis.from_url(f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}")
        holder = Ownership(ar, "w", 0, "gpu0@a", ttl_s=30)
        assert (await holder.acquire(_false, 0)).status == "ok"
        t0 = time.monotonic()
        got = await Ownership(ar, "w", 0, "gpu1@b", ttl_s=30).acquire(_false, 1.5)
        assert got.status == "held" and got.holder == holder.token
        assert time.monotonic() - t0 >= 1.5
        # A holder whose claim expired is replaced at once.
        r.pexpire(JobKeys("w").owner(0), 1)
        time.sleep(0.05)
        assert (await Ownership(ar, "w", 0, "gpu1@b", ttl_s=30).acquire(_false, 0)).status == "ok"
        await ar.aclose()

    asyncio.run(scenario())


def test_a_done_mark_without_a_stored_result_is_reopened(r: redis.Redis) -> None:
    async def scenario() -> None:
        ar = aioredis.from_url(f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}")
        k = JobKeys("d")
        r.sadd(k.done, 2)
        jobstate.set_batch_counts(r, "d", 2, {"completed": 5, "output_tokens": 50})
        assert jobstate.counters(r, "d")["completed"] == 5

        async def stored() -> bool:
            return True

        assert (await Ownership(ar, "d", 2, "n", 30).acquire(stored, 0)).status == "done"
        # The store lacks the result: the done mark and the batch's counts are dropped.
        assert (await Ownership(ar, "d", 2, "n", 30).acquire(_false, 0)).status == "ok"
        assert not r.sismember(k.done, 2)
        assert jobstate.counters(r, "d")["completed"] == 0
        await ar.aclose()

    asyncio.run(scenario())


def test_counting_a_stored_batch_never_doubles_rows_counted_live(r: redis.Redis,
                                                                 tmp_path: Path) -> None:
    store = open_store(tmp_path.as_uri(), None)
    k = JobKeys("c")
    r.set(k.owner(0), "tok")
    rows = [_row("c", 0, i) for i in range(4)] + [_row("c", 0, 4, "failed")]
    assert _record(r, "c", 0, "tok", rows) == 5
    store.put(result_key("c", 0), encode_rows(rows, compress=False))
    # A reconcile between the result write and the finish step, then the finish step.
    whereabouts.count_stored(store, r, "c", 0)
    whereabouts.count_stored(store, r, "c", 0)
    assert scripts.finish_batch(r, "c", 0, "tok") == 1
    c = jobstate.counters(r, "c")
    assert (c["completed"], c["failed"], c["output_tokens"]) == (4, 1, 12)
    # The result object deleted by hand: reopening forgets exactly what the batch added.
    assert ownership.reopen(r, "c", 0)
    assert jobstate.counters(r, "c") == dict.fromkeys(jobstate.COUNT_FIELDS, 0)


def test_a_failed_progress_flush_keeps_its_rows_for_the_next(r: redis.Redis,
                                                             tmp_path: Path) -> None:
    port = r.connection_pool.connection_kwargs["port"]
    store = open_store(tmp_path.as_uri(), None)

    async def scenario() -> None:
        ar = aioredis.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=0.2,
                               retry=None)
        rec = _owned_recorder(r, ar, store, "fl")
        await ar.ping()
        r.client_pause(10_000)  # Redis stops answering: the write times out
        try:
            with pytest.raises((redis.RedisError, OSError)):
                await rec.flush()
        finally:
            r.client_unpause()
        await rec.flush()
        raw = r.hgetall(JobKeys("fl").progress(0))
        chunks = {parse_unit_key(i): c.decode() for i, c in raw.items()}
        assert [x["index"] for x in read_progress(store, "fl", 0, chunks)] == [0, 1, 2]
        r.set(JobKeys("fl").owner(0), "another run")
        rec.add(_row("fl", 0, 3))
        with pytest.raises(LostOwnership):
            await rec.flush()
        await ar.aclose()

    asyncio.run(scenario())


class _Consumer:
    """Records what the intake asks of Celery's consumer (its call_soon interface)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def call_soon(self, fn, queue: str) -> None:
        self.calls.append((fn.__name__, queue))

    def cancel_task_queue(self, queue: str) -> None:  # pragma: no cover - named only
        pass

    def add_task_queue(self, queue: str) -> None:  # pragma: no cover - named only
        pass


class _App:
    class amqp:  # noqa: N801 - mirrors app.amqp.queues.consume_from
        class queues:  # noqa: N801
            consume_from = {"gpu3": None, "gpu": None}


def test_the_intake_stops_consuming_while_any_reason_holds() -> None:
    consumer = _Consumer()
    intake = Intake(consumer, _App)
    intake.close("engine")
    intake.close("lease")
    intake.open("engine")
    assert intake.closed
    intake.open("lease")
    assert not intake.closed
    assert consumer.calls == [("cancel_task_queue", "gpu3"), ("cancel_task_queue", "gpu"),
                              ("add_task_queue", "gpu3"), ("add_task_queue", "gpu")]


def test_lease_renewal_uses_redis_time_and_touches_only_its_own_deliveries(
        r: redis.Redis) -> None:
    prefix = ownership.worker_prefix("gpu0@a", 111)
    k = JobKeys("l")
    r.set(k.owner(0), prefix + "222|x")        # owned by this worker's pool
    r.set(k.owner(1), "gpu1@b|333|444|y")      # a stale copy: another worker owns it now
    r.zadd("unacked_index", {"t1": 1.0})
    held = [lease.Held("t0", k.owner(0), '["m0", "", "gpu"]'),
            lease.Held("t1", k.owner(1), '["m1", "", "gpu"]'),
            lease.Held("t2", k.owner(1), '["m2", "", "gpu"]')]
    lease.renew(r, "unacked_index", "unacked", prefix, held)
    now = float(r.time()[0])
    # Its own delivery's entry is written back (another copy's ack removed it) and renewed.
    assert r.hget("unacked", "t0") == b'["m0", "", "gpu"]'
    assert abs(r.zscore("unacked_index", "t0") - now) < 5
    # A stale copy only refreshes an entry that exists, and never recreates one.
    assert abs(r.zscore("unacked_index", "t1") - now) < 5
    assert r.zscore("unacked_index", "t2") is None and r.hget("unacked", "t2") is None


def test_the_lease_watchdog_closes_the_intake_while_redis_cannot_be_reached() -> None:
    dead = redis.Redis(port=free_port(), socket_timeout=0.2, socket_connect_timeout=0.2)
    consumer = _Consumer()
    intake = Intake(consumer, _App)
    keeper = lease.LeaseKeeper(dead, "unacked_index", 0.05, intake=intake, watchdog_s=0.3)
    keeper.last_ok -= 1
    keeper._watch()
    assert intake.is_closed("lease")
    keeper.last_ok = time.monotonic()
    keeper._watch()
    assert not intake.closed


def test_an_isolating_batch_gets_the_gpu_to_itself_and_knows_who_else_runs() -> None:
    now = 100.0
    old = Claim("j/1", 1.0, 40, 30, now)
    young = Claim("j/2", 2.0, 40, 10, now, exclusive=True)
    # While the younger batch isolates suspects, the older one sends nothing more ...
    assert allowed(old, [old, young], 50, now) == 0
    # ... and the isolating batch may send once the others have nothing in flight.
    assert allowed(young, [old, young], 50, now) == 50
    assert others_in_flight(young, [old, young], now) == 30
    # Of two isolating batches the older goes first.
    both = Claim("j/1", 1.0, 40, 0, now, exclusive=True)
    assert allowed(young, [both, young], 50, now) == 0


def _engine_spec(tmp_path: Path) -> EngineSpec:
    return EngineSpec(kind="sim", profile=load_profile("qwen36-27b"), gpu=0, host="127.0.0.1",
                      port=free_port(), log_path=tmp_path / "engine.log", stop_grace_s=2)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat.rsplit(")", 1)[-1].split()[0] == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


def test_the_engine_dies_with_its_guard_and_outlives_the_thread_that_spawned_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_SIM_STARTUP_S", "0.1")
    engine = Engine(_engine_spec(tmp_path))
    spawner = threading.Thread(target=engine.start)
    spawner.start()
    spawner.join()  # the spawning thread is gone: the engine must stay up
    try:
        engine.wait_ready(60)
        time.sleep(1.0)
        assert engine.alive() and engine.probe(5)
        guard = engine.pid
        (server,) = _children(guard)
        os.kill(guard, signal.SIGKILL)  # no clean-up runs in the guard
        assert _gone(server, 10), "the engine outlived its guard"
    finally:
        engine.stop()


def test_kombus_redis_layout_is_what_the_lease_and_reconcile_read(
        fleet_env, make_workers, tmp_path, r) -> None:
    """Fails loudly if kombu changes the private layout (``unacked``, ``unacked_index``)."""
    from tests.conftest import run_producer, write_prompts

    make_workers([0], FLEET_SIM_SPEED="1", FLEET_SIM_MEAN_OUTPUT_TOKENS="3000",
                 FLEET_BATCHES_PER_GPU="1")
    src = write_prompts(tmp_path / "p.jsonl", 20)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "lay", "--batch-size", "10",
                        "--max-new-tokens", "3000").returncode == 0
    deadline = time.monotonic() + 60
    while not r.hlen("unacked") and time.monotonic() < deadline:
        time.sleep(0.1)
    ((tag, value),) = r.hgetall("unacked").items()
    payload, exchange, routing_key = orjson.loads(value)
    assert payload["headers"]["task"] == "fleet.run_batch"
    assert routing_key in ("gpu", "gpu0") and isinstance(exchange, str)
    assert r.zscore("unacked_index", tag) is not None
    assert whereabouts.unacked_batches(r, "lay") <= {0, 1}
    assert whereabouts.message_batch(payload) in (("lay", 0), ("lay", 1))
    assert run_producer(fleet_env, "cancel", "--job", "lay").returncode == 0


def test_supported_delivery_libraries_are_pinned() -> None:
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    for lib in ("celery", "kombu", "redis"):
        line = next(x for x in text.splitlines() if x.strip().startswith(f'"{lib}'))
        assert "<" in line, f"{lib} has no upper bound: the lease reads kombu's private layout"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_janitor_resends_a_batch_lost_in_two_rounds_and_leaves_the_rest(
        r: redis.Redis, redis_server, tmp_path: Path) -> None:
    from config.settings import Settings
    from workers.dataset.jobs import JobSpec, save_spec
    from workers.delivery.janitor import Janitor
    from workers.wiring.celery_app import make_app

    store = open_store(tmp_path.as_uri(), None)
    app = make_app(Settings(redis_url=redis_server.url))
    spec = JobSpec(name="jan", total=30, batch_size=10, n_batches=3, input_path="x",
                   input_fingerprint="f")
    jobstate.register_job(r, "jan", spec.model_dump_json())
    other = spec.model_copy(update={"name": "elsewhere"})  # a job of another store
    jobstate.register_job(r, "elsewhere", other.model_dump_json())
    save_spec(store, spec)
    store.put(result_key("jan", 0), encode_rows([_row("jan", 0, 0)], compress=False))
    r.sadd(JobKeys("jan").done, 0)
    whereabouts.resend(r, app, spec, [1])  # batch 1 has a message; batch 2 has nothing
    janitor = Janitor(app, store, r, "gpu0@t", 60)
    assert janitor.round() == {}  # seen lost once: maybe a message in flight
    assert janitor.round() == {"jan": [2]}
    assert whereabouts.queued_batches(r, "jan") == {1, 2}
    assert janitor.round() == {}
    r.hset(JobKeys("jan").job, "state", "paused")
    r.delete("gpu")
    assert janitor.round() == {} and janitor.round() == {}  # a paused job is left alone


def test_a_forced_flush_beside_the_flusher_never_reuses_a_chunk(r: redis.Redis,
                                                                tmp_path: Path) -> None:
    """Two flushes at once (crash isolation forces one while the flusher runs) each write a
    chunk of their own: every recorded index finds its row."""
    port = r.connection_pool.connection_kwargs["port"]
    store = open_store(tmp_path.as_uri(), None)

    async def scenario() -> None:
        ar = aioredis.from_url(f"redis://127.0.0.1:{port}/0")
        rec = _owned_recorder(r, ar, store, "cf")
        first = asyncio.ensure_future(rec.flush())
        await asyncio.sleep(0)  # the first flush is inside its chunk write
        for i in range(3, 6):
            rec.add(_row("cf", 0, i))
        await asyncio.gather(first, rec.flush())
        await ar.aclose()

    asyncio.run(scenario())
    raw = r.hgetall(JobKeys("cf").progress(0))
    chunks = {parse_unit_key(i): c.decode() for i, c in raw.items()}
    assert len(set(chunks.values())) == 2
    assert [x["index"] for x in read_progress(store, "cf", 0, chunks)] == list(range(6))
