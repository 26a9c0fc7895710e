"""The tuner's hands on a live fleet: heartbeats, engine HTTP, Celery remote control.

Workers publish heartbeats in Redis (``workers.node.heartbeat``) and take a new launch profile
through the ``fleet_relaunch`` remote-control command; each owns its engine on
``engine_host:engine_base_port + gpu`` and logs it to ``log_dir/engine-gpu<N>.log``.
Throughput is read from the engine's ``sglang:realtime_tokens_total{mode="decode"}`` counter,
which SGLang bumps every step (``generation_tokens_total`` only moves when a request
finishes), with the worker's own output-token counter as the fallback.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from celery import Celery

from config.launch_profile import LaunchProfile, ProfileError, load_profile
from config.settings import Settings
from workers.engine.lifecycle import group_profile
from workers.engine.metrics import parse_metrics
from workers.errors import FleetError
from workers.node.gpu_group import GpuGroup
from workers.node.heartbeat import read_heartbeats
from workers.node.queues import SHARED_QUEUE
from workers.tune import snapshot as snapshots
from workers.tune.job_lengths import running_job_section
from workers.tune.snapshot import Snapshot, Target
from workers.wiring.control import send_relaunch

log = logging.getLogger(__name__)


# Consecutive polls that must find the engine full before a measurement starts.
BUSY_POLLS = 3
# Share of a window the engine must be full for its saturated rate to count.
MIN_SATURATED_SHARE = 0.3
# Samples per measurement window (at most one every SAMPLE_MAX_S).
SAMPLES_PER_WINDOW = 20
SAMPLE_MAX_S = 1.0


class TuneError(FleetError):
    """The tuner could not drive a worker (no reply, no heartbeat, engine never came back)."""


@dataclass(frozen=True)
class Timing:
    """How long the tuner waits and measures (seconds)."""

    window_s: float = 120.0  # one throughput measurement
    settle_timeout_s: float = 300.0  # wait for a restarted engine to fill up again
    restart_timeout_s: float = 1800.0  # a 54 GB model reload takes minutes
    poll_s: float = 1.0


@dataclass(frozen=True)
class Measurement:
    """Output tokens per second of one engine over a window.

    ``tok_s`` counts the whole window. ``saturated_tok_s`` counts only the stretches in which
    the engine was full (requests queued or running at its cap): the engine's own rate under
    its profile, free of the client's batch tails, which a canary restart makes worse (the
    batches in flight keep the concurrency they started with).
    """

    tok_s: float
    window_s: float
    source: str
    saturated_tok_s: float | None = None
    saturated_share: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """JSON form for reports."""
        saturated = None if self.saturated_tok_s is None else round(self.saturated_tok_s, 1)
        return {
            "tok_s": round(self.tok_s, 1),
            "saturated_tok_s": saturated,
            "saturated_share": round(self.saturated_share, 2),
            "window_s": round(self.window_s, 1),
            "source": self.source,
            "steady": self.steady,
        }

    @property
    def steady(self) -> bool:
        """Whether the engine was full (queue, or at its cap) for long enough of the window."""
        return self.saturated_tok_s is not None and self.saturated_share >= MIN_SATURATED_SHARE

    @property
    def rate(self) -> float:
        """The rate trials compare: saturated when the engine was full long enough."""
        return self.saturated_tok_s if self.steady and self.saturated_tok_s else self.tok_s


class ProfileBook:
    """Launch profiles by name: config/profiles, plus those the tuner made (kept as JSON)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __repr__(self) -> str:
        return f"<ProfileBook {self.folder}>"

    def remember(self, profile: LaunchProfile) -> Path:
        """Save a tuner-made profile so a later run (or a person) can find it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{profile.name}.json"
        path.write_text(profile.model_dump_json(indent=1) + "\n")
        return path

    def get(self, name: str) -> LaunchProfile:
        """The profile called ``name``; raises TuneError if there is none."""
        path = self.folder / f"{name}.json"
        if path.exists():
            return LaunchProfile.model_validate_json(path.read_text())
        try:
            return load_profile(name)
        except ProfileError as exc:
            raise TuneError(str(exc)) from exc


class Fleet:
    """Reads and drives the fleet's GPU workers."""

    def __init__(self, settings: Settings, r: redis.Redis, app: Celery, book: ProfileBook):
        self.settings, self.redis, self.app, self.book = settings, r, app, book
        self._cap: dict[str, int] = {}
        self._http = httpx.Client(timeout=5.0)  # polled every fraction of a second: one client

    def __repr__(self) -> str:
        return f"<Fleet nodes={[b['node'] for b in self.nodes()]}>"

    def nodes(self) -> list[dict[str, Any]]:
        """Every live worker's heartbeat, by node name."""
        return read_heartbeats(self.redis)

    def heartbeat(self, node: str) -> dict[str, Any]:
        """One worker's heartbeat; raises TuneError if it has none."""
        for beat in self.nodes():
            if beat["node"] == node:
                return beat
        raise TuneError(f"no heartbeat from {node}: is the worker running?")

    def profile_of(self, node: str) -> LaunchProfile:
        """The launch profile ``node`` runs now."""
        return self.book.get(self.heartbeat(node)["profile"])

    def base_url(self, node: str) -> str:
        """HTTP root of ``node``'s engine."""
        beat = self.heartbeat(node)
        port = beat.get("port") or self.settings.engine_port(beat["gpu"])
        return f"http://{self.settings.engine_host}:{port}"

    def relaunch(self, node: str, profile: LaunchProfile) -> None:
        """Ask ``node`` to restart its engine with ``profile`` (Celery remote control)."""
        answer = send_relaunch(self.app, node, profile.model_dump(), timeout_s=30)
        if not answer or not answer.get("ok"):
            raise TuneError(f"{node} did not accept profile {profile.name}: {answer}")
        log.info("%s relaunching with profile %s", node, profile.name)

    def wait_profile(self, node: str, name: str, timeout_s: float) -> None:
        """Wait until ``node`` reports a healthy engine running profile ``name``."""
        deadline = time.monotonic() + timeout_s
        beat: dict[str, Any] = {}
        while time.monotonic() < deadline:
            beat = next((b for b in self.nodes() if b["node"] == node), {})
            if beat.get("profile") == name and beat.get("engine_state") == "healthy":
                return
            time.sleep(0.2)
        raise TuneError(f"{node} not healthy with profile {name} after {timeout_s:.0f} s: {beat}")

    def _loads(self, node: str) -> dict[str, Any]:
        try:
            response = self._http.get(f"{self.base_url(node)}/v1/loads")
            response.raise_for_status()
            loads = response.json().get("loads") or [{}]
            return loads[0]
        except (httpx.HTTPError, ValueError):
            return {}

    def _busy(self, node: str) -> bool:
        load = self._loads(node)
        cap = load.get("max_running_requests") or 0
        running = load.get("num_running_reqs", 0)
        return load.get("num_waiting_reqs", 0) > 0 or bool(cap and running >= cap)

    def wait_busy(self, node: str, timeout_s: float, poll_s: float) -> bool:
        """Wait until ``node``'s engine stays full (queued requests, or running at its cap)."""
        deadline = time.monotonic() + timeout_s
        streak = 0
        while time.monotonic() < deadline:
            streak = streak + 1 if self._busy(node) else 0
            if streak >= BUSY_POLLS:
                return True
            time.sleep(poll_s)
        return False

    def _engine_sample(self, node: str) -> tuple[float, bool] | None:
        """(decode tokens so far, engine full?) from one /metrics read, or None."""
        try:
            response = self._http.get(f"{self.base_url(node)}/metrics")
            response.raise_for_status()
        except httpx.HTTPError:
            return None
        metrics = parse_metrics(response.text)
        tokens = metrics.total("realtime_tokens_total", mode="decode")
        if tokens is None:
            return None
        queued = metrics.total("num_queue_reqs") or 0
        running = metrics.total("num_running_reqs") or 0
        cap = self._cap.get(node) or 0
        return tokens, queued > 0 or bool(cap and running >= cap)

    def _sampled(self, node: str, window_s: float) -> Measurement | None:
        self._cap[node] = self._loads(node).get("max_running_requests") or 0
        step = min(SAMPLE_MAX_S, window_s / SAMPLES_PER_WINDOW)
        first = self._engine_sample(node)
        if first is None:
            return None
        t0 = prev_t = time.monotonic()
        prev, full_tokens, full_s = first, 0.0, 0.0
        while prev_t - t0 < window_s:
            time.sleep(step)
            sample, now = self._engine_sample(node), time.monotonic()
            if sample is None or sample[0] < prev[0]:
                raise TuneError(f"{node}: engine metrics unreadable or reset during the window")
            if prev[1] and sample[1]:
                full_tokens += sample[0] - prev[0]
                full_s += now - prev_t
            prev, prev_t = sample, now
        elapsed = prev_t - t0
        return Measurement(
            (prev[0] - first[0]) / elapsed,
            elapsed,
            "engine sglang:realtime_tokens_total{mode=decode}",
            full_tokens / full_s if full_s else None,
            full_s / elapsed,
        )

    def measure(self, node: str, window_s: float) -> Measurement:
        """Output tok/s of ``node`` over ``window_s``; raises TuneError if the engine restarted."""
        sampled = self._sampled(node, window_s)
        if sampled is not None:
            return sampled
        start = float(self.heartbeat(node).get("output_tokens") or 0)
        t0 = time.monotonic()
        time.sleep(window_s)
        end = float(self.heartbeat(node).get("output_tokens") or 0)
        elapsed = time.monotonic() - t0
        return Measurement(max(0.0, end - start) / elapsed, elapsed, "heartbeat output_tokens")

    def client_section(self, node: str) -> dict[str, Any]:
        """The snapshot's ``client`` section: the worker's heartbeat and the queue depth."""
        beat = self.heartbeat(node)
        queue = beat.get("queue") or f"gpu{beat['gpu']}"
        queued = self.redis.llen(SHARED_QUEUE) + self.redis.llen(queue)
        return {**beat, "queued_batches": queued}

    def snapshot(self, node: str) -> Snapshot:
        """A snapshot of ``node``'s engine (the tuner runs on the workers' host)."""
        beat = self.heartbeat(node)
        gpu = int(beat["gpu"])
        # A GPU group's engine: every GPU read by NVML, its log named after the group, and
        # the profile as launched there (--tp-size), so the memory arithmetic is per GPU.
        gpus = tuple(int(g) for g in beat.get("gpus") or [gpu])
        group = GpuGroup(gpus)
        log_path = self.settings.log_dir / f"engine-{group.name}.log"
        target = Target(gpu, self.base_url(node), log_path, gpus=gpus)
        profile = group_profile(self.profile_of(node), group.size)
        snap = snapshots.capture(
            target, self.client_section(node), json.loads(profile.model_dump_json()),
            running_job_section(self.settings, self.redis, node),
        )
        if self.settings.engine == "sim":  # the simulated GPU, not the host's
            snap["gpu_memory_mib"] = self.settings.sim.gpu_memory_mib
        return snap
