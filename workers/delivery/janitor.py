"""The janitor: resend, without an operator, every batch of a running job that is lost.

``enqueue`` and ``resume`` reconcile when someone runs them; a message can also vanish while
nobody watches (a failover that kept one write and lost the next, a worker that died in
Celery's own connection-loss clean-up, a delivery acked by a run that lost its batch just
before the new owner died, a task revoked from Flower). Every ``FLEET_RECONCILE_INTERVAL_S``
one worker of the fleet (whoever takes the round's lock) derives where each batch of each
running job is (workers/delivery/whereabouts.py) and resends those that are lost in two
rounds in a row: a message on its way from a queue list to kombu's unacked hash is invisible
for an instant, and a second look keeps such a batch from being sent twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from workers.dataset.jobs import JobSpec, job_key
from workers.dataset.location import recorded_store
from workers.dataset.store import Store
from workers.delivery import whereabouts
from workers.redisdb.keys import JANITOR_LOCK_KEY, JOBS_KEY, JobKeys

log = logging.getLogger(__name__)

class Janitor(threading.Thread):
    """Background thread of a GPU worker's main process (see the module docstring)."""

    def __init__(self, app: Any, store: Store, client: redis.Redis, node: str,
                 interval_s: float, unacked_key: str = "unacked",
                 open_url: Callable[[str], Store] | None = None) -> None:
        super().__init__(name="fleet-janitor", daemon=True)
        self._app, self._store, self._r, self._node = app, store, client, node
        # A job's own store (workers/dataset/location.py); without it, the worker's store.
        self._open_url = open_url
        self._interval, self._unacked = interval_s, unacked_key
        self._stop_event = threading.Event()
        self._suspects: dict[str, set[int]] = {}

    def run(self) -> None:
        """One round per interval until stopped; nothing ends the thread."""
        while not self._stop_event.wait(self._interval):
            try:
                if self._r.set(JANITOR_LOCK_KEY, self._node, nx=True, px=int(self._interval * 900)):
                    self.round()
            except Exception as exc:  # noqa: BLE001 - the janitor must outlive any one failure
                log.warning("janitor round failed: %s", exc)

    def stop(self) -> None:
        """Stop after the current round."""
        self._stop_event.set()

    def _job_store(self, job: str) -> Store:
        url = recorded_store(self._r, job) if self._open_url else None
        return self._open_url(url) if self._open_url and url else self._store

    def round(self) -> dict[str, list[int]]:
        """Resend what was lost in this round and the last; return it by job."""
        sent: dict[str, list[int]] = {}
        for raw in sorted(self._r.smembers(JOBS_KEY)):
            job = raw.decode()
            spec_raw, state = self._r.hmget(JobKeys(job).job, ["spec", "state"])
            store = self._job_store(job)
            # Only running jobs whose store holds them (a job Redis remembers from a store that
            # is gone is not this fleet's to regenerate).
            if spec_raw is None or (state or b"running") != b"running" \
                    or not store.exists(job_key(job)):
                self._suspects.pop(job, None)
                continue
            spec = JobSpec.model_validate_json(spec_raw)
            where = whereabouts.locate(store, self._r, job, self._unacked)
            lost = set(where.lost(range(spec.n_batches)))
            confirmed = sorted(lost & self._suspects.get(job, set()))
            self._suspects[job] = lost - set(confirmed)
            if confirmed:
                log.warning("job %s: batches %s had no message and no live run: resent",
                            job, confirmed[:20])
                whereabouts.resend(self._r, self._app, spec, confirmed)
                sent[job] = confirmed
        return sent
