"""Celery wiring only: identity (and refusals) at worker_init, the engine bootstep, shutdown
hooks.

The engine starts in a worker bootstep that runs before the Consumer step (Celery starts the
consumer last), and ``start`` blocks until the engine is healthy: nothing is consumed before
the engine can serve it. The engine is stopped from ``worker_shutdown`` (after the pool has
drained running batches), never from the step's ``stop`` (which runs before the pool drains).
"""

from __future__ import annotations

import atexit
import functools
import logging
import sys
import time

import redis
from celery import bootsteps, signals

from config.launch_profile import ProfileError, load_profile
from config.settings import Settings, load_settings
from workers.dataset.store import open_store
from workers.delivery import job_progress, lease
from workers.delivery.intake import Intake
from workers.delivery.janitor import Janitor
from workers.engine.lifecycle import ParallelismMismatch, group_profile
from workers.node import context, gpu_group
from workers.node.gpu_group import GpuGroup, GroupError
from workers.node.queues import SHARED_QUEUE, SINK_QUEUE
from workers.observe.events import worker_info
from workers.wiring.runtime import WorkerRuntime

log = logging.getLogger(__name__)

_runtime: WorkerRuntime | None = None
_janitor: Janitor | None = None


def current_runtime() -> WorkerRuntime | None:
    """The runtime of this worker's main process (None elsewhere)."""
    return _runtime


def _sink_only(app: object) -> bool:
    """Whether this worker consumes only the sink queue (no GPU, no engine)."""
    return list(app.amqp.queues.consume_from or {}) == [SINK_QUEUE]  # type: ignore[attr-defined]


# Exit code of a worker that cannot reach Redis at start (the CLI's RET_CONNECT).
EXIT_NO_REDIS = 4


def refuse(reason: str, code: int = 2) -> None:
    """Stop the worker before Celery starts, with one line on stderr (Celery's logging is
    not set up yet at worker_init, so a log record would be printed bare, a second time)."""
    print(f"fleet worker refused: {reason}", file=sys.stderr, flush=True)
    # SystemExit passes through Celery's signal dispatch (it catches Exception only).
    raise SystemExit(code)


def _wait_for_redis(settings: Settings) -> None:
    """Refuse (one line, exit 4) when Redis does not answer within FLEET_REDIS_STARTUP_WAIT_S,
    rather than let Celery retry the broker with a traceback per attempt."""
    client = redis.Redis.from_url(settings.redis_url.get_secret_value(),
                                  socket_connect_timeout=2, socket_timeout=2)
    deadline = time.monotonic() + settings.redis_startup_wait_s
    try:
        while True:
            try:
                client.ping()
                return
            except redis.RedisError as exc:
                if time.monotonic() >= deadline:
                    where = client.connection_pool.connection_kwargs
                    at = where.get("path") or f"{where.get('host')}:{where.get('port')}"
                    refuse(f"cannot reach Redis at {at} after "
                           f"{settings.redis_startup_wait_s:g} s ({type(exc).__name__}); start "
                           "it or fix FLEET_REDIS_URL (FLEET_REDIS_STARTUP_WAIT_S: how long "
                           "to wait)", EXIT_NO_REDIS)
                time.sleep(0.5)
    finally:
        client.close()


def _claim(settings: Settings, node: str, group: GpuGroup, queue: str) -> None:
    """Own the group's GPUs on this host; a Redis that is not up yet is not a refusal (the
    heartbeat claims them once it is)."""
    client = redis.Redis.from_url(settings.redis_url.get_secret_value(),
                                  **settings.redis_client_options())
    try:
        gpu_group.claim(client, node, group, queue,
                        gpu_group.claim_ttl_s(settings.heartbeat_interval_s))
    except redis.RedisError as exc:
        log.warning("could not claim %s yet (%s): the heartbeat claims it once Redis answers",
                    group.describe(), exc)
    finally:
        client.close()


def _check_present(settings: Settings, group: GpuGroup, queue: str) -> None:
    """Refuse a queue naming a GPU this node does not have: the simulator's node has
    FLEET_SIM_GPUS, a real one what NVML counts (unknown without NVML: the engine's start
    then says what is wrong)."""
    if settings.engine == "sim":
        gpu_group.check_present(group, queue, settings.sim.gpus, "FLEET_SIM_GPUS")
        return
    from workers.tune.gpu import GpuUnavailable, device_count, nvml_indices

    try:
        count = device_count()
    except GpuUnavailable as exc:
        log.warning("cannot count this node's GPUs (%s): %s not checked", exc, queue)
        return
    gpu_group.check_present(group, queue, count, "NVML", nvml_indices(group.gpus))


@signals.worker_init.connect
def _on_worker_init(sender: object, **_: object) -> None:
    """Work out the GPU group from -Q / FLEET_GPU, check it, claim it, and also consume the
    shared queue (and the sink queue, FLEET_SINK_ON_GPU_WORKERS). Every refusal is one line
    and stops the worker."""
    settings = load_settings()
    _wait_for_redis(settings)
    if _sink_only(sender.app):  # type: ignore[attr-defined]
        log.info("fleet sink worker %s: no GPU, no engine", getattr(sender, "hostname", "?"))
        return
    # httpx logs every request at INFO: a health probe every few seconds drowns the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    queues = sender.app.amqp.queues  # type: ignore[attr-defined]
    own = list(queues.consume_from or {})
    node = sender.hostname  # type: ignore[attr-defined]
    try:
        group, queue = gpu_group.group_from_queues(own, settings.gpu)
        gpu_group.check_cuda_device(settings.cuda_device, group, queue)
        _check_present(settings, group, queue)
        group_profile(load_profile(settings.profile), group.size, f"queue {queue}")
        _claim(settings, node, group, queue)
    except (GroupError, ParallelismMismatch, ProfileError) as exc:
        refuse(str(exc))
    if queue not in own:
        queues.select_add(queue)
    if SHARED_QUEUE not in own:
        queues.select_add(SHARED_QUEUE)
    if settings.sink_on_gpu_workers and SINK_QUEUE not in own:
        queues.select_add(SINK_QUEUE)
    me = context.set_identity(node, group, settings.engine_port(group.first), queue)
    log.info("fleet worker %s: %s, engine port %d, queues %s", me.node, group.describe(),
             me.port, list(queues.consume_from))


class EngineStep(bootsteps.StartStopStep):
    """Start this worker's engine before any batch is consumed."""

    requires = {"celery.worker.components:Pool"}

    def start(self, worker: object) -> None:
        """Launch the engine and wait for health (a model load can take minutes)."""
        global _runtime
        if _sink_only(worker.app):  # type: ignore[attr-defined]
            # No engine to start; the sink tasks' leases still need renewing.
            from workers.wiring.sink_task import start_lease_keeper

            start_lease_keeper(worker.app)  # type: ignore[attr-defined]
            return
        settings = load_settings()
        client = redis.Redis.from_url(settings.redis_url.get_secret_value(),
                                      **settings.redis_client_options())
        app = worker.app  # type: ignore[attr-defined]
        intake = Intake(getattr(worker, "consumer", None), app)
        _runtime = WorkerRuntime(settings, context.identity(), client, lease.index_key(app),
                                 intake=intake, unacked_key=lease.unacked_key(app))
        atexit.register(_runtime.stop)
        _runtime.start()
        _start_janitor(app, settings, client)

    def info(self, worker: object) -> dict[str, object]:
        """GPU group, engine state, running/cap, queue, tokens/s and each job's state and data
        set for ``inspect stats`` (Flower)."""
        if _runtime is None:
            return {}
        info = worker_info(_runtime.heartbeat_payload())
        try:
            info["fleet_jobs"] = job_progress.brief(_runtime.redis)
        except redis.RedisError:
            info["fleet_jobs"] = "Redis unreachable"
        return info


def _start_janitor(app: object, settings: Settings, client: redis.Redis) -> None:
    global _janitor
    if settings.reconcile_interval_s <= 0:
        return
    _janitor = Janitor(app, open_store(settings.store_url, settings.s3), client,
                       context.identity().node, settings.reconcile_interval_s,
                       lease.unacked_key(app),
                       open_url=functools.lru_cache(maxsize=16)(
                           lambda url: open_store(url, settings.s3)))
    _janitor.start()


@signals.worker_shutting_down.connect
def _on_worker_shutting_down(**_: object) -> None:
    """SIGTERM (warm shutdown): hand the running batches back instead of waiting for them."""
    if _runtime is not None:
        _runtime.hand_back()


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: object) -> None:
    if _janitor is not None:
        _janitor.stop()
    if _runtime is not None:
        _runtime.stop()
