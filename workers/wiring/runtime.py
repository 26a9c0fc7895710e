"""What a GPU worker's main process runs beside Celery: its engine, a monitor, its heartbeat.

Stop order (warm shutdown): Celery stops consuming; ``worker_shutting_down`` asks the running
batches to hand themselves back (answered prompts kept), so the pool drains in seconds rather
than after a whole batch; then ``worker_shutdown`` calls :meth:`WorkerRuntime.stop`, which stops
renewing leases, stops the monitor, terminates the engine's process group and deletes the
heartbeat. While the engine is unhealthy or restarting, or leases cannot be renewed, the
worker takes no new batch (workers/delivery/intake.py). After a SIGKILL of
the worker none of this runs: the engine guard's parent-death signal takes the engine down,
the heartbeat key expires and the leases lapse.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any

import redis
from celery.worker import state as worker_state

from config.launch_profile import LaunchProfile, load_profile
from config.settings import Settings
from workers.dataset.manifest import launch_digest
from workers.delivery import gpu_share
from workers.delivery.intake import Intake
from workers.delivery.lease import LeaseKeeper
from workers.delivery.ownership import worker_prefix
from workers.delivery.stall import StallWatch
from workers.engine.lifecycle import Engine, EngineSpec, ParallelismMismatch
from workers.engine.relaunch_guard import RelaunchRefused
from workers.errors import EngineStartFailed
from workers.node import gpu_group, heartbeat
from workers.node.context import WorkerIdentity
from workers.observe.gauges import WorkerWatch
from workers.observe.metrics import Exporter, FleetCollector
from workers.redisdb.keys import NodeKeys
from workers.retry import RetryPolicy, backoff_s

log = logging.getLogger(__name__)

# A relaunch profile that fails to start this many times is replaced by the last good one.
PROFILE_START_ATTEMPTS = 2
# The hand-back request outlives any warm shutdown (batches check it every second).
HANDBACK_TTL_S = 600


class WorkerRuntime:
    """Owns one engine and keeps it healthy while the worker lives."""

    def __init__(self, settings: Settings, me: WorkerIdentity, redis_client: redis.Redis,
                 lease_index_key: str, intake: Intake | None = None,
                 unacked_key: str = "unacked") -> None:
        self.settings, self.me, self.redis = settings, me, redis_client
        self.keys = NodeKeys(me.node)
        profile = load_profile(settings.profile)
        self.group = me.group
        self.engine = Engine(EngineSpec(
            kind=settings.engine, profile=profile, gpu=me.gpu, host=settings.engine_host,
            port=me.port, log_path=settings.log_dir / f"engine-{self.group.name}.log",
            stop_grace_s=settings.engine_stop_grace_s, cuda_device=settings.cuda_device,
            gpus=self.group.gpus,
        ))
        self.intake = intake or Intake(None, None)
        self.lease = LeaseKeeper(redis_client, lease_index_key, settings.lease_renew_s,
                                 unacked_key=unacked_key,
                                 owner_prefix=worker_prefix(me.node, os.getpid()),
                                 intake=self.intake, watchdog_s=settings.lease_watchdog_s)
        self._stop = threading.Event()
        self._relaunch: LaunchProfile | None = None
        # Profiles a relaunch message may name (workers/engine/relaunch_guard.py): this
        # worker's own.
        self._trusted: dict[str, LaunchProfile] = {profile.name: profile}
        self._monitor = threading.Thread(target=self._watch, name="fleet-engine", daemon=True)
        self._beat = threading.Thread(target=self._beat_loop, name="fleet-heartbeat", daemon=True)
        self._failed_probes = 0
        self.stall = StallWatch(settings.engine_stall_timeout_s)
        # Engine gauges + recent tokens/s for heartbeat, Flower and Prometheus (main process).
        self.watch = WorkerWatch(self.engine.spec.base_url, redis_client, me.node,
                                 settings.heartbeat_interval_s, settings.rate_window_s)
        self.exporter = Exporter(FleetCollector(redis_client, me.node, self.group.label,
                                                self.watch, self.engine, self.group.size),
                                 settings.metrics_host, settings.metrics_base_port + me.gpu)

    def __repr__(self) -> str:
        return f"<WorkerRuntime {self.me.node} {self.engine!r}>"

    def start(self) -> None:
        """Start the engine and wait until it is healthy, then start the background threads."""
        self.redis.delete(self.keys.handback)  # left by this node's last shutdown
        self.lease.start()
        self.engine.start()
        self.watch.start()
        if self.settings.metrics_enabled:
            self.exporter.start()
        self._beat.start()
        self.engine.wait_ready(self.settings.engine_start_timeout_s)
        self._publish()
        self._monitor.start()

    def stop(self) -> None:
        """Stop leases, monitor, engine and heartbeat (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.lease.stop()
        self.watch.stop()
        self.exporter.stop()
        self.engine.stop()
        try:
            self.redis.delete(self.keys.heartbeat)
            gpu_group.release(self.redis, self.me.node, self.group)
        except redis.RedisError:
            pass

    def hand_back(self) -> None:
        """Warm shutdown: the running batches stop sending and go back to the queue with
        their answered prompts kept (they look for this key every second)."""
        try:
            self.redis.set(self.keys.handback, 1, ex=HANDBACK_TTL_S)
        except redis.RedisError as exc:
            log.warning("could not ask running batches to hand back: %s", exc)

    def known_profiles(self) -> list[LaunchProfile]:
        """Profiles this worker trusts for a relaunch: the current one first, then the
        start-up one and those it validated (config/profiles/ is read by the guard)."""
        current = self.engine.spec.profile
        return [current, *(p for p in self._trusted.values() if p.name != current.name)]

    def trust_profile(self, profile: LaunchProfile) -> None:
        """Remember a profile the relaunch guard built, so it can be named again later."""
        self._trusted[profile.name] = profile

    def request_relaunch(self, profile: LaunchProfile) -> None:
        """Ask the monitor to restart the engine with ``profile`` (tuner, remote control);
        RelaunchRefused when its tp-size / dp-size do not fit this worker's GPU group."""
        try:
            replace(self.engine.spec, profile=profile)  # EngineSpec checks the fit
        except ParallelismMismatch as exc:
            raise RelaunchRefused(str(exc)) from None
        self._relaunch = profile

    def _restart(self, reason: str, profile: LaunchProfile | None = None) -> None:
        """Restart until the engine is healthy; a new profile that will not start is rolled
        back after PROFILE_START_ATTEMPTS tries, and a newer relaunch request wins at once."""
        policy = RetryPolicy(max_attempts=1_000_000, base_s=2.0, max_s=60.0)
        if profile is None:
            # Batches read this to tell a crash (blame the prompts in flight) from a relaunch.
            self.redis.hincrby(self.keys.stats, "crash_restarts", 1)
        self.stall.reset()
        self.intake.close("engine")  # nothing new is taken until the engine is healthy again
        known_good, attempt = self.engine.spec.profile, 0
        while not self._stop.is_set():
            attempt += 1
            if self._relaunch is not None:
                profile, self._relaunch, attempt = self._relaunch, None, 1
            elif profile is not None and attempt > PROFILE_START_ATTEMPTS:
                log.error("profile %s did not start %d times: rolling back to %s",
                          profile.name, PROFILE_START_ATTEMPTS, known_good.name)
                profile, attempt = known_good, 1
            log.warning("restarting engine on %s (%s), attempt %d", self.group.describe(),
                        reason, attempt)
            try:
                self.engine.restart(self.settings.engine_start_timeout_s, profile)
                self._failed_probes = 0
                self.intake.open("engine")
                return
            except EngineStartFailed as exc:
                log.error("%s", exc)
                self._stop.wait(backoff_s(attempt, policy))

    def _check(self) -> None:
        if self._relaunch is not None:
            profile, self._relaunch = self._relaunch, None
            self._restart(f"relaunch with profile {profile.name}", profile)
        elif not self.engine.alive():
            self._restart("engine process exited")
        elif self.stall.stalled(self.engine.spec.base_url):
            self._restart(f"no token progress for {self.settings.engine_stall_timeout_s:.0f} s")
        elif self.stall.serving:  # tokens moved since the last check: no probe needed
            self._failed_probes = 0
            self.intake.open("engine")
        elif not self.engine.probe(self.settings.engine_probe_timeout_s):
            self._failed_probes += 1
            self.intake.close("engine")
            if self._failed_probes >= self.settings.engine_unhealthy_after:
                self._restart(f"{self._failed_probes} failed health probes")
        else:
            self._failed_probes = 0
            self.intake.open("engine")

    def _watch(self) -> None:
        while not self._stop.wait(self.settings.engine_health_interval_s):
            try:
                self._check()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one failure
                log.exception("engine monitor on %s: unexpected error (monitor continues)",
                              self.group.describe())

    def _beat_loop(self) -> None:
        # Its own thread: a restart that reloads a 54 GB model must not look like a dead worker.
        while True:
            try:
                self._publish()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            if self._stop.wait(self.settings.heartbeat_interval_s):
                return

    def _tokens_per_sec(self) -> tuple[int, float]:
        # Cached by the watch thread: Flower's inspect (workers/wiring/signals.py) calls this too.
        return self.watch.output_tokens, self.watch.tokens_per_sec

    def _in_flight(self) -> int:
        """Requests this worker's batches have in flight (reported by the pool children)."""
        raw = self.redis.hgetall(self.keys.in_flight)
        return gpu_share.in_flight_total(raw, time.time())

    def heartbeat_payload(self) -> dict[str, Any]:
        """What this worker tells the fleet about itself."""
        tokens, rate = self._tokens_per_sec()
        return {
            "node": self.me.node, "host": self.me.host, "gpu": self.me.gpu,
            # The GPU group: its GPUs, label (the gpu label of metrics), queue and tp-size.
            "gpus": list(self.group.gpus), "group": self.group.label,
            "queue": self.me.gpu_queue, "tp_size": self.engine.spec.tp_size,
            "port": self.me.port, "engine": self.settings.engine,
            "engine_state": self.engine.state.value,
            "engine_pid": self.engine.pid, "engine_restarts": self.engine.restarts,
            "health_probes": self.engine.probes,
            "profile": self.engine.spec.profile.name,
            "launch_digest": launch_digest(self.engine.spec.profile),
            "output_flags": self.engine.spec.profile.output_flags(),
            "batches_running": len(worker_state.active_requests),
            "in_flight": self._in_flight(),
            "client_concurrency": self.engine.spec.profile.client_concurrency,
            "output_tokens": tokens, "tokens_per_sec": round(rate, 1),
            **self.watch.engine_fields(),
            "updated_at": time.time(),
        }

    def _publish(self) -> None:
        ttl = 2 * self.settings.heartbeat_interval_s + 1
        heartbeat.publish(self.redis, self.me.node, self.heartbeat_payload(), ttl)
        try:  # the GPUs stay this worker's while it beats
            gpu_group.claim(self.redis, self.me.node, self.group, self.me.gpu_queue,
                            gpu_group.claim_ttl_s(self.settings.heartbeat_interval_s))
        except gpu_group.GroupError as exc:
            log.error("%s", exc)
