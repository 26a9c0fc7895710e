"""One place for each thing (issue 35): the token-checked key scripts, the node keys, a
batch's units, and no dead helpers beside them."""

from __future__ import annotations

import redis

from workers.batch import runner
from workers.dataset import sink_lock
from workers.delivery import jobstate, ownership
from workers.node import context


def test_batch_ownership_and_the_data_set_lock_share_one_lock_implementation():
    assert ownership.RENEW is sink_lock.TAKE_OR_KEEP and ownership.RELEASE is sink_lock.RELEASE


def test_the_shared_take_or_keep_script_honours_the_blocking_set(r: redis.Redis):
    take = sink_lock.TAKE_OR_KEEP
    assert r.eval(take, 1, "k", "me", 5000) == 1 and r.eval(take, 1, "k", "you", 5000) == 0
    assert r.eval(sink_lock.RELEASE, 1, "k", "you") == 0 and r.get("k") == b"me"
    assert r.eval(sink_lock.RELEASE, 1, "k", "me") == 1 and r.get("k") is None
    r.sadd("done", "3")  # a done batch is not taken again by a lapsed claim
    assert r.eval(take, 2, "k", "done", "me", 5000, "3") == 0 and r.get("k") is None
    assert r.eval(take, 2, "k", "done", "me", 5000, "4") == 1


def test_node_keys_live_in_jobstate_and_dead_helpers_are_gone():
    assert jobstate.handback_key("gpu0@h") == "fleet:node:gpu0@h:handback"
    assert not hasattr(runner, "handback_key") and not hasattr(runner, "units_of")
    assert not hasattr(context, "gpu_from_queues")
