"""Renew the Redis visibility lease of the batches this worker holds.

kombu's Redis transport emulates acks with a sorted set (``unacked_index``) scored by delivery
time and a hash (``unacked``) of the delivered messages (``kombu.transport.redis.QoS.append``,
kombu 5.7); any worker's sweep (``QoS.restore_visible``) requeues entries older than
``visibility_timeout``. A fixed timeout cannot both recover a dead worker's batch quickly and
never re-run a live, slow one, so the timeout is short and the main process of a live worker
moves the score of each message it holds to "now" every few seconds. If the worker dies (even
SIGKILL), renewal stops and the batch is swept back within ``visibility_timeout`` plus one sweep.

Rules that keep two runs of one batch apart (with workers/delivery/ownership.py):

- scores are Redis's own clock (``TIME`` inside the script), never a host's;
- a redelivered message keeps its delivery tag, so a worker holding a stale copy must not keep
  the new holder's entry alive for long: only deliveries whose batch this worker's pool owns
  are renewed unconditionally (and their entry written back if another copy's ack removed
  it); any other held tag is only refreshed while its entry exists (``XX``), which lasts until
  the stale run notices it lost the batch (one ownership renewal period);
- a watchdog: when no renewal has succeeded for ``lease_watchdog_s`` the worker stops taking
  new batches (workers/delivery/intake.py) until renewals work again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from celery.worker import state as worker_state
from kombu.utils.json import dumps

from workers.delivery.intake import Intake
from workers.node.queues import BATCH_TASK
from workers.redisdb import scripts
from workers.redisdb.keys import JobKeys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Held:
    """One message this worker has reserved: its tag, its batch's owner key, kombu's record."""

    tag: str
    owner_key: str
    unacked_value: str


def _requests() -> list[Any]:
    for _ in range(5):
        try:
            return list(worker_state.requests.values())
        except RuntimeError:  # the dict changed while we copied it; try again
            continue
    return []


def held_deliveries() -> list[Held]:
    """Every message this worker has reserved (running or about to)."""
    out = []
    for req in _requests():
        # Request.delivery_info drops the tag; the kombu message keeps it.
        msg = req.message
        tag = getattr(msg, "delivery_tag", None)
        if not tag:
            continue
        owner_key = ""
        if req.name == BATCH_TASK:
            try:
                owner_key = JobKeys(str(req.args[0])).owner(int(req.args[1]))
            except (TypeError, IndexError, ValueError):
                owner_key = ""
        info = msg.delivery_info or {}
        value = dumps([getattr(msg, "_raw", None), info.get("exchange"), info.get("routing_key")])
        out.append(Held(str(tag), owner_key, value))
    return out


def renew(client: redis.Redis, index_key: str, unacked_key: str, prefix: str,
          held: list[Held]) -> int:
    """Move the lease of each held delivery to Redis's now (see the module docstring)."""
    if not held:
        return 0
    return int(scripts.renew_leases(client, index_key, unacked_key, prefix,
                                    [(h.tag, h.owner_key, h.unacked_value) for h in held]) or 0)


class LeaseKeeper(threading.Thread):
    """Background thread that renews this worker's leases every ``interval_s``."""

    def __init__(self, client: redis.Redis, index_key: str, interval_s: float, *,
                 unacked_key: str = "unacked", owner_prefix: str = "",
                 intake: Intake | None = None, watchdog_s: float | None = None) -> None:
        super().__init__(name="fleet-lease", daemon=True)
        self._client, self._key, self._interval = client, index_key, interval_s
        self._unacked, self._prefix = unacked_key, owner_prefix
        self._intake, self._watchdog_s = intake, watchdog_s
        self._stop_event = threading.Event()
        self.last_ok = time.monotonic()

    def run(self) -> None:
        """Renew until stopped; nothing (a Redis error included) ends the thread."""
        while not self._stop_event.wait(self._interval):
            try:
                renew(self._client, self._key, self._unacked, self._prefix, held_deliveries())
                self.last_ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the lease must outlive any one failure
                log.warning("lease renewal failed: %s", exc)
            self._watch()

    def _watch(self) -> None:
        if self._intake is None or self._watchdog_s is None:
            return
        silent = time.monotonic() - self.last_ok
        if silent > self._watchdog_s:
            if not self._intake.is_closed("lease"):
                log.error("no lease renewal for %.0f s: taking no new batch until Redis answers",
                          silent)
            self._intake.close("lease")
        else:
            self._intake.open("lease")

    def stop(self) -> None:
        """Stop renewing."""
        self._stop_event.set()


def index_key(app: Any) -> str:
    """Name of kombu's unacked index for ``app``'s broker (``unacked_index`` by default)."""
    opts = app.conf.broker_transport_options or {}
    return str(opts.get("unacked_index_key", "unacked_index"))


def unacked_key(app: Any) -> str:
    """Name of kombu's hash of delivered, unacknowledged messages (``unacked`` by default)."""
    opts = app.conf.broker_transport_options or {}
    return str(opts.get("unacked_key", "unacked"))
