"""A job's ``status --watch --json`` followed in one process, restarted when it exits.

The runner waits on two jobs for tens of seconds; a ``status`` process per poll costs ~0.7 s
of CPU each time, which on a 2-core machine slows the very fleet under test. The watch fails
while Redis restarts (a schedule's fault): the feed then starts it again a second later.
"""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Any

import orjson

from tests.conftest import ROOT, status_watch_argv

RESTART_AFTER_S = 1.0


class StatusFeed:
    """The latest ``status --json`` of ``job``, from a watch process kept running."""

    def __init__(self, env: dict[str, str], job: str, interval_s: float = 1.0) -> None:
        self.env, self.job, self.interval_s = env, job, interval_s
        self._latest: tuple[float, dict[str, Any]] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"feed-{job}", daemon=True)
        self._thread.start()

    def latest(self, max_age_s: float = 5.0) -> dict[str, Any] | None:
        """The last status printed within ``max_age_s``; None when there is none that fresh
        (the watch failing, as a status command would)."""
        with self._lock:
            if self._latest is None or time.monotonic() - self._latest[0] > max_age_s:
                return None
            return self._latest[1]

    def stop(self) -> None:
        """End the watch process and the thread."""
        self._stopped.set()
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopped.is_set():
            proc = subprocess.Popen(status_watch_argv(self.job, self.interval_s), env=self.env,
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            with self._lock:
                self._proc = proc
            assert proc.stdout is not None
            for line in proc.stdout:
                try:
                    st = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                with self._lock:
                    self._latest = (time.monotonic(), st)
            proc.wait()  # the job done, or the watch failed (Redis restarting)
            self._stopped.wait(RESTART_AFTER_S)
