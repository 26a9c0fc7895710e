"""Issue 37, item 2: at the job's end a held batch's unsent rows move to an idle GPU as a part,
each row answered exactly once, through SIGKILL and lapsed leases in the middle of a split."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from tests.conftest import run_producer, wait_done, write_prompts
from tests.test_delivery import _rows, _verify, _wait_for
from tests.test_delivery_ops import _pool_children
from workers.delivery.gpu_share import Claim
from workers.redisdb import scripts
from workers.redisdb.keys import JobKeys, NodeKeys
from workers.split import asker, owner


def _aio(r: redis.Redis) -> aioredis.Redis:
    return aioredis.from_url(f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}")


def _record(r: redis.Redis, job: str, batch: int, fence: str, token: str, index: int) -> int:
    row = orjson.dumps({"index": index})
    return int(scripts.record_rows(r, job, batch, "n", token, [(index, row, "ok", 3)], fence))


def test_a_grant_is_fenced_by_the_owner_and_a_part_records_only_while_it_lives(r):
    async def scenario() -> None:
        ar = _aio(r)
        r.set(JobKeys("s").owner(0), "owner-tok")
        req = await asker.request_rows(ar, "s", 0, "part-tok")
        assert req is not None
        assert await asker.request_rows(ar, "s", 0, "other-tok") is None  # one at a time
        # A run that does not own the batch cannot grant; the request stays open.
        assert await owner.grant(ar, "s", 0, "stale-tok", req, ["5", "6"], 30) == -1
        assert await owner.open_request(ar, "s", 0) == req
        assert await owner.grant(ar, "s", 0, "owner-tok", req, ["5", "6"], 30) == 1
        assert await owner.open_request(ar, "s", 0) is None
        assert await asker.await_grant(ar, "s", 0, req, 1) == {"5", "6"}
        assert await owner.live_part_rows(ar, "s", 0) == {"5", "6"}
        pkey = JobKeys("s").part(0, req.part)
        # The part records through its own claim, never through the batch's owner key.
        assert _record(r, "s", 0, pkey, "part-tok", 5) == 1
        assert _record(r, "s", 0, None, "part-tok", 6) == -1
        r.delete(pkey)  # the part's claim lapsed (its worker was killed or froze)
        assert await owner.live_part_rows(ar, "s", 0) == frozenset()
        assert _record(r, "s", 0, pkey, "part-tok", 6) == -1
        assert _record(r, "s", 0, None, "owner-tok", 6) == 1
        # The part's row 5 and the owner's row 6, each once.
        assert sorted(r.hkeys(JobKeys("s").progress(0))) == [b"5", b"6"]
        await owner.drop_parts(ar, "s", 0)
        assert not r.keys("fleet:job:s:part*")
        await ar.aclose()

    asyncio.run(scenario())


def test_an_unanswered_request_is_withdrawn_and_a_refused_one_ends_at_once(r):
    async def scenario() -> None:
        ar = _aio(r)
        req = await asker.request_rows(ar, "u", 1, "tok")
        t0 = time.monotonic()
        assert await asker.await_grant(ar, "u", 1, req, 0.3) == frozenset()
        assert time.monotonic() - t0 >= 0.3 and await owner.open_request(ar, "u", 1) is None
        req = await asker.request_rows(ar, "u", 1, "tok")
        await owner.refuse(ar, "u", 1, req)
        t0 = time.monotonic()
        assert await asker.await_grant(ar, "u", 1, req, 5) == frozenset()
        assert time.monotonic() - t0 < 1
        await ar.aclose()

    asyncio.run(scenario())


def test_the_batch_to_split_is_another_nodes_live_one_with_the_most_unsent_rows():
    now = time.time()

    def claim(tag: str, claim: int, in_flight: int, at: float = now, **kw) -> Claim:
        return Claim(tag, 0.0, claim, in_flight, at, **kw)

    claims = {
        "me": [claim("j/9", 500, 0)],
        "a": [claim("j/1", 50, 40), claim("j/2", 90, 40, exclusive=True)],
        "b": [claim("j/3", 70, 40), claim("j/3+p1", 400, 0), claim("j/4", 300, 0, at=now - 60)],
        "c": [claim("a/b/7", 42, 40)],
    }
    found = asker.choose(claims, "me", 4, now)
    assert (found.job, found.batch, found.node, found.unsent) == ("j", 3, "b", 30)
    assert asker.choose(claims, "me", 31, now) is None
    assert asker.choose({"c": claims["c"]}, "me", 2, now).job == "a/b"
    assert owner.rows_to_move(60, 40) == 50 and owner.rows_to_move(10, 40) == 10


N = 120


def _two_workers(make_workers, fleet_env, tmp_path, r, job: str, n: int = N, **env: str):
    """Worker A takes the job's one batch; then worker B starts idle beside it. A sends 4 at a
    time, so under suite load (B slow to start) it still has unsent rows when B asks."""
    slow = {"FLEET_SIM_SPEED": "1", "FLEET_SIM_MEAN_OUTPUT_TOKENS": "200", **env}
    (a,) = make_workers([0], **slow, FLEET_CLIENT_CONCURRENCY="4")
    src = write_prompts(tmp_path / "p.jsonl", n)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", job, "--batch-size", str(n),
                        "--max-new-tokens", "400").returncode == 0
    _wait_for(lambda: r.exists(f"fleet:job:{job}:owner:0"), 60, "the batch taken")
    # B's engine is slower, so its part is still running when the tests' faults come.
    (b,) = make_workers([1], **{**slow, "FLEET_SIM_SPEED": "0.25"})
    return a, b


def _exactly_once(env: dict[str, str], job: str, n: int) -> list[dict]:
    report = _verify(env, job)
    assert report["ok"] and report["duplicates"] == 0 and report["rows"] == n, report
    rows = _rows(env, job)
    assert sorted(row["index"] for row in rows) == list(range(n))
    return rows


def _part_answering(r: redis.Redis, job: str, node: str) -> None:
    """Until a part is granted and ``node`` (which holds no batch) has answered rows of it."""
    _wait_for(lambda: r.scard(JobKeys(job).parts(0)) >= 1, 60, "a part granted")
    _wait_for(lambda: int(r.hget(NodeKeys(node).stats, "rows") or 0) >= 5, 60,
              "the part's first rows recorded")


def test_an_idle_gpu_takes_the_unsent_rows_of_the_last_batch(fleet_env, make_workers, tmp_path,
                                                             r):
    a, b = _two_workers(make_workers, fleet_env, tmp_path, r, "sp")
    _part_answering(r, "sp", b.node)
    wait_done(fleet_env, "sp", timeout_s=120)
    rows = _exactly_once(fleet_env, "sp", N)
    by_node = {node: sum(row["node"] == node for row in rows) for node in (a.node, b.node)}
    assert by_node[b.node] >= 10 and by_node[a.node] >= 10, by_node
    # B held no batch: every row it answered came through a part, and status counts them.
    splits = orjson.loads(run_producer(fleet_env, "status", "--job", "sp", "--json").stdout)
    assert splits["splits"]["parts"] >= 1 and splits["splits"]["rows"] == by_node[b.node]
    table = run_producer(fleet_env, "status", "--job", "sp").stdout
    assert f"{by_node[b.node]} rows to idle GPUs" in table, table
    assert not r.keys("fleet:job:sp:part*") and not r.exists(JobKeys("sp").split_request(0))


@pytest.mark.parametrize("victim", ["part", "owner"])
def test_a_split_survives_sigkill_of_either_side(fleet_env, make_workers, tmp_path, r, victim):
    lease = {"FLEET_VISIBILITY_TIMEOUT_S": "6", "FLEET_LEASE_RENEW_S": "1",
             "FLEET_SWEEP_INTERVAL_S": "1"}
    job = f"sk{victim}"
    a, b = _two_workers(make_workers, fleet_env, tmp_path, r, job, **lease)
    _part_answering(r, job, b.node)
    (b if victim == "part" else a).kill()
    # A killed owner's batch comes back (acks late) to B, which waits for its own live part and
    # then sends what the owner had in flight; a killed part's rows come back to the owner once
    # its claim lapses, and a fresh idle GPU may ask for them again.
    if victim == "part":
        make_workers([2], **lease)
    wait_done(fleet_env, job, timeout_s=150)
    _exactly_once(fleet_env, job, N)


def test_a_part_frozen_past_its_lease_gives_its_rows_back_and_is_not_taken_again(
        fleet_env, make_workers, tmp_path, r):
    lease = {"FLEET_VISIBILITY_TIMEOUT_S": "6", "FLEET_LEASE_RENEW_S": "1",
             "FLEET_SWEEP_INTERVAL_S": "1"}
    a, b = _two_workers(make_workers, fleet_env, tmp_path, r, "fz", **lease)
    _part_answering(r, "fz", b.node)
    parts = {p.decode() for p in r.smembers(JobKeys("fz").parts(0))}
    frozen = [b.proc.pid, *_pool_children(b.proc.pid)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        _wait_for(lambda: not asyncio.run(_live(r, "fz")), 30, "the part's claim lapsed")
    finally:
        for pid in reversed(frozen):
            os.kill(pid, signal.SIGCONT)
    # Woken, the part finds its claim gone: it never renews it back (EXTEND only), so the
    # owner's next pass sends those rows. B may ask for a new part of what is still unsent.
    for _ in range(6):
        time.sleep(0.5)
        assert not any(r.exists(JobKeys("fz").part(0, p)) for p in parts), "a part came back"
    wait_done(fleet_env, "fz", timeout_s=150)
    _exactly_once(fleet_env, "fz", N)


async def _live(r: redis.Redis, job: str) -> frozenset[str]:
    ar = _aio(r)
    try:
        return await owner.live_part_rows(ar, job, 0)
    finally:
        await ar.aclose()
