"""The one lock every writer of a job's data set holds: the sink (worker or ``--local``) and
``requeue-failed``.

A Redis key holding the owner's token, set with a short TTL and renewed by a thread while the
owner works. Renewal and release compare the token first (in Lua, so the check and the write
are one step): an owner whose lock expired never extends or deletes a lock another run took
since. :meth:`SinkLock.check` raises :class:`LockLost` when renewal found the lock gone; the
sink calls it before its commit (the manifest write) and before deleting anything.

The token checks are the fleet's one implementation of a token-checked key
(workers/redisdb/scripts.py), which batch ownership (workers/delivery/ownership.py) uses too.
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType

import redis

from workers.errors import FleetError
from workers.redisdb import scripts
from workers.redisdb.keys import JobKeys

log = logging.getLogger(__name__)

LOCK_TTL_S = 60.0

class LockLost(FleetError):
    """The lock expired or was taken by another run while its owner worked."""


class SinkLock:
    """An owner-checked, renewed lock on one job's data set (see the module docstring)."""

    def __init__(self, r: redis.Redis, job: str, token: str, ttl_s: float = LOCK_TTL_S) -> None:
        self.r, self.job, self.token, self.ttl_s = r, job, token, ttl_s
        self.key = JobKeys(job).sink_lock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost = False

    def __repr__(self) -> str:
        return f"<SinkLock {self.key} token={self.token[:8]} lost={self._lost}>"

    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    def try_acquire(self) -> bool:
        """Take the lock (or take back our own); False when another owner holds it."""
        got = bool(scripts.take_or_keep(self.r, self.key, self.token, self._ttl_ms()))
        if got:
            self._lost = False
            self._start_renewal()
        return got

    def acquire(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Wait up to ``timeout_s`` for the lock; FleetError naming the holder if it stays busy."""
        deadline = time.monotonic() + timeout_s
        while not self.try_acquire():
            if time.monotonic() >= deadline:
                holder = (self.r.get(self.key) or b"?").decode()
                raise FleetError(f"the data set of job {self.job} is being written by another "
                                 f"run (lock {self.key} held by {holder}); try again later")
            time.sleep(poll_s)

    def _start_renewal(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                            name=f"sink-lock-{self.job}")
            self._thread.start()

    def _renew_loop(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not scripts.extend_if_owner(self.r, self.key, self.token, self._ttl_ms()):
                    self._lost = True
                    log.error("lock %s lost: another run holds it now", self.key)
                    return
                last_ok = time.monotonic()
            except redis.RedisError as exc:
                log.warning("cannot renew lock %s: %s", self.key, exc)
                if time.monotonic() - last_ok >= self.ttl_s:
                    self._lost = True
                    return

    @property
    def lost(self) -> bool:
        """Whether renewal found the lock gone (no Redis call)."""
        return self._lost

    def check(self) -> None:
        """Raise LockLost unless the lock is still ours (asked of Redis, not just the thread)."""
        if self._lost or (self.r.get(self.key) or b"").decode() != self.token:
            self._lost = True
            raise LockLost(f"lost the lock on the data set of job {self.job}; another run "
                           "writes it now, this one stops without committing")

    def release(self) -> None:
        """Stop renewing and delete the lock if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            scripts.release_if_owner(self.r, self.key, self.token)
        except redis.RedisError as exc:  # it expires on its own
            log.warning("cannot release lock %s: %s", self.key, exc)

    def __enter__(self) -> SinkLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
