"""The elastic hold (workers/delivery/hold.py): a worker takes another batch only when the
batches it holds have nothing left to send and the GPU's budget has room."""

from __future__ import annotations

import threading
import time

import orjson

from tests.conftest import run_producer, wait_done, write_prompts
from workers.delivery.gpu_share import STALE_S, Claim
from workers.delivery.hold import has_room, wanted
from workers.redisdb.keys import NodeKeys


def _c(tag: str, claim: int, in_flight: int, budget: int = 10, at: float = 100.0,
       exclusive: bool = False) -> Claim:
    return Claim(tag, 1.0, claim, in_flight, at, exclusive, budget)


def test_another_batch_only_when_every_held_one_is_fully_sent_and_the_budget_has_room():
    assert wanted([], 100.0, 8) == 1  # a starting worker takes one batch
    assert wanted([_c("j/0", 40, 10)], 100.0, 8) == 1  # 30 still to send
    assert wanted([_c("j/0", 7, 7)], 100.0, 8) == 2  # its tail: 3 slots free
    assert wanted([_c("j/0", 9, 7)], 100.0, 8) == 2  # 2 to send, and room for them and one more
    assert wanted([_c("j/0", 10, 10)], 100.0, 8) == 1  # fully sent but the budget is full
    assert wanted([_c("j/0", 12, 8)], 100.0, 8) == 1  # what is left fills the budget
    tail, young = _c("j/0", 4, 4), _c("j/1", 40, 6)
    assert wanted([tail, young], 100.0, 8) == 2  # the younger batch fills the engine
    assert wanted([_c("j/0", 2, 2), _c("j/1", 3, 3)], 100.0, 8) == 3
    assert wanted([_c(f"j/{i}", 0, 0) for i in range(8)], 100.0, 8) == 8  # the bound
    assert not has_room([_c("j/0", 2, 2, exclusive=True)])  # isolating crash suspects
    # A batch taken that has not claimed yet (or one writing its results): nothing more.
    assert wanted([_c("j/0", 2, 2)], 100.0, 8, held=2) == 1
    assert wanted([_c("j/0", 2, 2)], 100.0, 8, held=1) == 2
    dead = _c("j/0", 40, 0, at=100.0 - STALE_S - 1)
    assert wanted([dead], 100.0, 8) == 1


def _sample(r, keys: list[str], out: list[list[list[dict]]], stop: threading.Event) -> None:
    while not stop.is_set():
        out.append([[orjson.loads(v) for v in r.hvals(k)] for k in keys])
        time.sleep(0.02)


def test_a_worker_holds_more_batches_only_as_its_batches_run_out_of_prompts_to_send(
        fleet_env, make_workers, tmp_path, r):
    # Rows long enough that a batch's tail (under 6 unfinished) outlasts taking the next one.
    (worker,) = make_workers([0], FLEET_CLIENT_CONCURRENCY="6", FLEET_SIM_SPEED="1",
                             FLEET_BATCHES_PER_GPU="4", FLEET_SIM_MEAN_OUTPUT_TOKENS="120")
    samples: list[list[list[dict]]] = []
    stop = threading.Event()
    t = threading.Thread(target=_sample, args=(r, [NodeKeys(worker.node).in_flight],
                                                samples, stop), daemon=True)
    t.start()
    prompts = write_prompts(tmp_path / "prompts.jsonl", 120)
    res = run_producer(fleet_env, "enqueue", str(prompts), "--job", "hold", "--batch-size",
                       "20", "--max-new-tokens", "200")
    assert res.returncode == 0, res.stderr
    assert wait_done(fleet_env, "hold")["completed"] == 120
    stop.set()
    t.join()
    claims = [s[0] for s in samples]
    # A batch was only taken in the others' tails: besides the youngest, the batches held never
    # had more unfinished prompts than the budget (6) between them (a sample can catch one
    # prompt between its outcome and its claim's refresh).
    older = [sum(x["claim"] for x in sorted(c, key=lambda x: x["started"])[:-1])
             for c in claims if len(c) > 1]
    assert older, "never more than one batch held"
    assert max(older) <= 6 + 1, older
    assert max(len(c) for c in claims) >= 2  # more than one batch held at times


def test_two_workers_share_a_job_of_two_batches(fleet_env, make_workers, tmp_path, r):
    workers = make_workers([0, 1], FLEET_CLIENT_CONCURRENCY="4", FLEET_SIM_SPEED="1",
                           FLEET_BATCHES_PER_GPU="8")
    samples: list[list[list[dict]]] = []
    stop = threading.Event()
    keys = [NodeKeys(w.node).in_flight for w in workers]
    t = threading.Thread(target=_sample, args=(r, keys, samples, stop), daemon=True)
    t.start()
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    res = run_producer(fleet_env, "enqueue", str(prompts), "--job", "two", "--batch-size",
                       "20", "--max-new-tokens", "200")
    assert res.returncode == 0, res.stderr
    assert wait_done(fleet_env, "two")["completed"] == 40
    stop.set()
    t.join()
    # Each GPU ran a batch (a worker taking both at once left the other GPU idle).
    assert all(any(s[i] for s in samples) for i in range(2))


class _Qos:
    """kombu's QoS as the hold moves it (value, increment/decrement_eventually)."""

    def __init__(self) -> None:
        self.value = 1

    def increment_eventually(self, n: int) -> None:
        self.value += n

    def decrement_eventually(self, n: int) -> None:
        self.value -= n


def test_a_worker_running_its_last_rows_with_room_asks_for_another_gpus_rows(r):
    # The job-end split's ask (workers/split/asker.py, run by workers/wiring/hold_step.py)
    # runs whenever the hold has room for more than the worker holds: not only once it holds
    # nothing, but also while its own batch is fully sent and its last rows leave free slots
    # (docs/delivery.md).
    from workers.delivery.hold import ElasticHold

    asks: list[int] = []
    held: list[frozenset[str]] = [frozenset({"m1"})]
    hold = ElasticHold(r, "gpu0@t", _Qos, lambda: held[0], 4, lambda: asks.append(1))
    key = NodeKeys("gpu0@t").in_flight
    now = time.time()
    r.hset(key, "j/0", _c("j/0", 40, 40, budget=51, at=now).encode())  # 11 slots free
    assert hold.tick() == 2 and asks == [1]
    r.hset(key, "j/0", _c("j/0", 60, 51, budget=51, at=now).encode())  # rows still to send
    assert hold.tick() == 1 and asks == [1]
    held[0] = frozenset()
    r.delete(key)
    assert hold.tick() == 1 and asks == [1, 1]  # holding nothing: asks, as before


def test_the_consumer_loop_is_woken_once_when_a_read_becomes_allowed(r):
    # A consumer loop with nothing to read looks at ``can_consume`` only between polls of up
    # to a second (kombu's Hub.create_loop): the hold wakes it when room for a batch appears.
    from workers.delivery.hold import ElasticHold

    wakes: list[int] = []
    held: list[frozenset[str]] = [frozenset({"m1"})]
    hold = ElasticHold(r, "gpu0@w", _Qos, lambda: held[0], 4, wake=lambda: wakes.append(1))
    key = NodeKeys("gpu0@w").in_flight
    now = time.time()
    r.hset(key, "j/0", _c("j/0", 60, 51, budget=51, at=now).encode())  # rows still to send
    assert hold.tick() == 1 and not hold.may_take() and wakes == []
    r.hset(key, "j/0", _c("j/0", 40, 40, budget=51, at=now).encode())  # room: wake
    assert hold.tick() == 2 and hold.may_take() and wakes == [1]
    assert hold.tick() == 2 and wakes == [1]  # still room: the loop was woken already
    held[0] = frozenset({"m1", "m2"})  # the next batch arrived: no read allowed
    r.hset(key, "j/1", _c("j/1", 100, 0, budget=51, at=now + 1).encode())
    assert hold.tick() == 2 and not hold.may_take() and wakes == [1]
