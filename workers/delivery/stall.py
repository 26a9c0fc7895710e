"""Detect an engine that hangs: requests running, yet no token produced for a long time.

A hung scheduler may still answer ``/health`` slowly or not at all; the direct evidence is the
engine's own decode counter (``sglang:realtime_tokens_total{mode="decode"}``, bumped every
step; SGLang 0.5.11 ``srt/observability/scheduler_metrics_mixin.py``) standing still while
``sglang:num_running_reqs`` is above zero.
Engines started without ``--enable-metrics`` are never judged stalled (no evidence).

The same reading says when the engine is plainly serving (the counter moved since the last
reading): the worker's monitor then skips its ``/health`` probe, because SGLang answers
``/health`` by running a 1-token generation through the scheduler (``http_server.
health_generate``), which takes a slot of a prefill round from the job's rows.
"""

from __future__ import annotations

import time

import httpx

from workers.engine.metrics import parse_metrics


def token_progress(base_url: str, http: httpx.Client) -> tuple[float, float] | None:
    """(running requests, decode tokens so far) from /metrics, or None if unreadable."""
    try:
        resp = http.get(f"{base_url}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    m = parse_metrics(resp.text)
    running = m.total("num_running_reqs")
    tokens = m.total("realtime_tokens_total", mode="decode")
    if tokens is None:
        tokens = m.total("generation_tokens_total")
    if running is None or tokens is None:
        return None
    return running, tokens


class StallWatch:
    """Remembers when the decode counter last moved while requests were running."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last: tuple[float, float] | None = None  # (monotonic time, tokens)
        self.serving = False  # the decode counter moved between the last two readings
        self._http = httpx.Client()  # one for the watch's life (see Engine._http)

    def reset(self) -> None:
        """Forget the history (after a restart)."""
        self._last = None
        self.serving = False

    def stalled(self, base_url: str) -> bool:
        """True once running > 0 and the token counter has not moved for ``timeout_s``."""
        progress = token_progress(base_url, self._http)
        now = time.monotonic()
        if progress is None:
            self.serving = False
            return False
        running, tokens = progress
        self.serving = self._last is not None and tokens != self._last[1]
        if running == 0 or self._last is None or tokens != self._last[1]:
            self._last = (now, tokens)
            return False
        return now - self._last[0] > self.timeout_s
