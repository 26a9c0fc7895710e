"""Celery wiring only: identity at worker_init, the engine bootstep, shutdown hooks.

The engine starts in a worker bootstep that runs before the Consumer step (Celery starts the
consumer last), and ``start`` blocks until the engine is healthy: nothing is consumed before
the engine can serve it. The engine is stopped from ``worker_shutdown`` (after the pool has
drained running batches), never from the step's ``stop`` (which runs before the pool drains).
"""

from __future__ import annotations

import atexit
import logging

import redis
from celery import bootsteps, signals

from config.settings import Settings, load_settings
from workers import context
from workers.celery_app import SHARED_QUEUE, SINK_QUEUE
from workers.dataset.store import open_store
from workers.delivery import lease
from workers.delivery.gate import ConsumerGate
from workers.delivery.janitor import Janitor
from workers.events import worker_info
from workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)

_runtime: WorkerRuntime | None = None
_janitor: Janitor | None = None


def current_runtime() -> WorkerRuntime | None:
    """The runtime of this worker's main process (None elsewhere)."""
    return _runtime


def _sink_only(app: object) -> bool:
    """Whether this worker consumes only the sink queue (no GPU, no engine)."""
    return list(app.amqp.queues.consume_from or {}) == [SINK_QUEUE]  # type: ignore[attr-defined]


@signals.worker_init.connect
def _on_worker_init(sender: object, **_: object) -> None:
    """Work out the GPU from -Q gpuN / FLEET_GPU and also consume the shared queue."""
    if _sink_only(sender.app):  # type: ignore[attr-defined]
        log.info("fleet sink worker %s: no GPU, no engine", getattr(sender, "hostname", "?"))
        return
    settings = load_settings()
    # httpx logs every request at INFO: a health probe every few seconds drowns the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    queues = sender.app.amqp.queues  # type: ignore[attr-defined]
    own = list(queues.consume_from or {})
    gpu = context.gpu_from_queues(own, settings.gpu)
    if f"gpu{gpu}" not in own:
        queues.select_add(f"gpu{gpu}")
    if SHARED_QUEUE not in own:
        queues.select_add(SHARED_QUEUE)
    me = context.set_identity(sender.hostname, gpu, settings.engine_port(gpu))  # type: ignore[attr-defined]
    log.info("fleet worker %s: GPU %d, engine port %d, queues %s", me.node, me.gpu, me.port,
             list(queues.consume_from))


class EngineStep(bootsteps.StartStopStep):
    """Start this worker's engine before any batch is consumed."""

    requires = {"celery.worker.components:Pool"}

    def start(self, worker: object) -> None:
        """Launch the engine and wait for health (a model load can take minutes)."""
        global _runtime
        if _sink_only(worker.app):  # type: ignore[attr-defined]
            # No engine to start; the sink tasks' leases still need renewing.
            from workers.dataset.sink import start_lease_keeper

            start_lease_keeper(worker.app)  # type: ignore[attr-defined]
            return
        settings = load_settings()
        client = redis.Redis.from_url(settings.redis_url.get_secret_value(),
                                      **settings.redis_client_options())
        app = worker.app  # type: ignore[attr-defined]
        gate = ConsumerGate(getattr(worker, "consumer", None), app)
        _runtime = WorkerRuntime(settings, context.identity(), client, lease.index_key(app),
                                 gate=gate, unacked_key=lease.unacked_key(app))
        atexit.register(_runtime.stop)
        _runtime.start()
        _start_janitor(app, settings, client)

    def info(self, worker: object) -> dict[str, object]:
        """GPU, engine state, running/cap, queue, tokens/s for ``inspect stats`` (Flower)."""
        return worker_info(_runtime.heartbeat_payload()) if _runtime is not None else {}



def _start_janitor(app: object, settings: Settings, client: redis.Redis) -> None:
    global _janitor
    if settings.reconcile_interval_s <= 0:
        return
    _janitor = Janitor(app, open_store(settings.store_url, settings.s3), client,
                       context.identity().node, settings.reconcile_interval_s,
                       lease.unacked_key(app))
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
