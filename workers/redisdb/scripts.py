"""The fleet's Lua scripts (``lua/*.lua``, one file per script) as named calls.

Each script is read from the package once into one redis-py ``Script`` and one
``AsyncScript`` that hold no client (a batch task's client lives for one task): each call
names its client and sends EVALSHA, and the server loads a script once (SCRIPT LOAD on
NOSCRIPT, or in the pipeline that first runs it). Every call takes a sync or asyncio client,
or a pipeline of either, and returns the script's reply (on an asyncio client: an awaitable
of it). The calls build their KEYS from :mod:`workers.redisdb.keys`, so no caller knows a
script's argument order.

A token-checked key (a lock, a batch's claim, a part's claim, a split request) has one
implementation: :func:`take_or_keep`, :func:`extend_if_owner` and :func:`release_if_owner`.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript, Script

from workers.redisdb.keys import JobKeys, NodeKeys, bucket, gpu_owner_key

# A Redis client (redis.Redis, redis.asyncio.Redis) or a pipeline of either.
Client = Any
# A script's reply, or an awaitable of it on an asyncio client.
Reply = Any

_USES = re.compile(r"^-- uses: (\w+)", re.MULTILINE)


@functools.cache
def source(name: str) -> str:
    """The text of ``lua/<name>.lua``, after the helpers it names (``-- uses: helper``,
    ``lua/lib/<helper>.lua``)."""
    lua = resources.files(__package__).joinpath("lua")
    text = lua.joinpath(f"{name}.lua").read_text()
    helpers = [lua.joinpath("lib", f"{h}.lua").read_text() for h in _USES.findall(text)]
    return "\n".join([*helpers, text])


@functools.cache
def _script(name: str, on_asyncio: bool) -> Script | AsyncScript:
    # Given bytes, redis-py needs no client to hash the script.
    return (AsyncScript if on_asyncio else Script)(None, source(name).encode())


def _run(r: Client, name: str, keys: Sequence[str], args: Iterable[Any]) -> Reply:
    script = _script(name, isinstance(r, aioredis.Redis))
    return script(keys=list(keys), args=list(args), client=r)


# --- token-checked keys ----------------------------------------------------------------------
def take_or_keep(r: Client, key: str, token: str, ttl_ms: int,
                 unless_in: tuple[str, Any] | None = None) -> Reply:
    """Keep ``key`` if it holds ``token`` (extended), else take it if it is free, unless the
    set ``unless_in[0]`` holds the member ``unless_in[1]``. 1: ours now, 0: not."""
    if unless_in is None:
        return _run(r, "take_or_keep", [key], [token, ttl_ms])
    return _run(r, "take_or_keep", [key, unless_in[0]], [token, ttl_ms, unless_in[1]])


def extend_if_owner(r: Client, key: str, token: str, ttl_ms: int) -> Reply:
    """Extend ``key`` only while it holds ``token``. 1: extended, 0: not ours."""
    return _run(r, "extend_if_owner", [key], [token, ttl_ms])


def release_if_owner(r: Client, key: str, token: str) -> Reply:
    """Delete ``key`` only while it holds ``token``. 1: deleted, 0: not ours."""
    return _run(r, "release_if_owner", [key], [token])


def pause_if_running(r: Client, job: str, why: str) -> Reply:
    """Pause ``job`` with ``why`` as its ``paused_by``, only while it is running.
    1: paused, 0: it was paused or cancelled already."""
    return _run(r, "pause_if_running", [JobKeys(job).job], [why])


# --- a batch's rows, claim and end -------------------------------------------------------------
def record_rows(r: Client, job: str, batch: int, node: str, token: str,
                rows: list[tuple[int | str, bytes, str, int]], fence: str | None = None,
                tally: Sequence[str] | None = None) -> Reply:
    """Record answered ``rows`` (unit key, row or chunk name, kind, output tokens) of
    ``batch`` as the holder of ``token`` in ``fence`` (the batch's owner key by default, or a
    part's). Each row counts once in the job's counters, and in ``tally`` (the keys of the
    rows series, the tokens series and ``node``'s lifetime counters; the job's and the node's
    by default). -1: the fence does not hold ``token``; else the rows counted."""
    k = JobKeys(job)
    if tally is None:
        tally = (k.series_n, k.series_tok, NodeKeys(node).stats)
    now = time.time()
    argv: list[Any] = [batch, bucket(now), node, token, round(now, 3)]
    for unit, row, kind, tokens in rows:
        argv += [unit, row, kind, tokens]
    return _run(r, "record_rows", [k.progress(batch), k.stats, k.done, *tally,
                                   fence or k.owner(batch), k.bstats, k.job], argv)


def finish_batch(r: Client, job: str, batch: int, token: str) -> Reply:
    """Mark ``batch`` done and drop its progress and claim, while ``token`` owns it.
    1: done, 0: another run owns it."""
    k = JobKeys(job)
    return _run(r, "finish_batch", [k.done, k.progress(batch), k.owner(batch)], [batch, token])


def set_batch_counts(r: Client, job: str, batch: int, counts: Iterable[tuple[str, int]]
                     ) -> Reply:
    """Make ``batch``'s contribution to the job's counters exactly ``counts``."""
    k = JobKeys(job)
    return _run(r, "set_batch_counts", [k.stats, k.bstats],
                [batch, *(x for pair in counts for x in pair)])


def claim_batch(r: Client, job: str, batch: int, token: str, ttl_ms: int, reopen: bool,
                steal_from: str) -> Reply:
    """Claim ``batch`` for ``token``: [b'ok' | b'done' | b'held', holder] (see
    ``lua/claim_batch.lua``); ``reopen`` drops a done mark the store does not back,
    ``steal_from`` names a holder known to be dead."""
    k = JobKeys(job)
    return _run(r, "claim_batch", [k.owner(batch), k.done, k.stats, k.bstats, k.progress(batch)],
                [batch, token, ttl_ms, "1" if reopen else "0", steal_from])


def reopen_batch(r: Client, job: str, batch: int) -> Reply:
    """Forget ``batch``'s done mark and counts unless a run owns it. 1: nothing owns it."""
    k = JobKeys(job)
    return _run(r, "reopen_batch", [k.owner(batch), k.done, k.stats, k.bstats,
                                    k.progress(batch)], [batch])


def drop_unowned_progress(r: Client, job: str, batch: int) -> Reply:
    """Drop a stored batch's progress hash unless a run owns the batch. 1: dropped."""
    k = JobKeys(job)
    return _run(r, "drop_unowned_progress", [k.owner(batch), k.progress(batch)], [])


def grant_part(r: Client, job: str, batch: int, owner_token: str, request: str, part: str,
               unit_keys: list[str], ttl_ms: int, parts_ttl_s: int) -> Reply:
    """Give ``unit_keys`` to the asker of the open split ``request`` (as read) as ``part``.
    -1: ``owner_token`` does not own the batch; 0: the request changed or is gone; 1: granted."""
    k = JobKeys(job)
    return _run(r, "grant_part", [k.owner(batch), k.split_request(batch), k.part(batch, part),
                                  k.part_rows(batch, part), k.parts(batch), k.job],
                [owner_token, request, ttl_ms, part, parts_ttl_s, *unit_keys])


# --- the worker's leases and GPUs, the sink's trigger --------------------------------------------
def renew_leases(r: Client, index_key: str, unacked_key: str, prefix: str,
                 held: Iterable[tuple[str, str, str]]) -> Reply:
    """Move the kombu lease of each held (tag, owner key, unacked value) to Redis's now;
    ``prefix`` starts the tokens of this worker's pool. Returns the entries moved."""
    return _run(r, "renew_leases", [index_key, unacked_key],
                [prefix, *(x for h in held for x in h)])


def claim_sink_trigger(r: Client, job: str, n_batches: int, dedup_s: int) -> Reply:
    """Mark the job's sink queued once every batch is done (once per ``dedup_s``).
    1: the caller enqueues it."""
    k = JobKeys(job)
    return _run(r, "claim_sink_trigger", [k.done, k.sink_auto, k.sink],
                [n_batches, dedup_s, time.time()])


def claim_gpus(r: Client, host: str, gpus: Sequence[int], node: str, ttl_ms: int) -> Reply:
    """Own every GPU of ``host`` in ``gpus`` as ``node``, all or none: [] when done, else
    [1-based index of the GPU refused, its owner]."""
    return _run(r, "claim_gpus", [gpu_owner_key(host, g) for g in gpus], [node, ttl_ms])


def release_gpus(r: Client, host: str, gpus: Sequence[int], node: str) -> Reply:
    """Drop ``node``'s claims on ``gpus`` of ``host``."""
    return _run(r, "release_gpus", [gpu_owner_key(host, g) for g in gpus], [node])
