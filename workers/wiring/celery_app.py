"""The Celery application (``celery -A workers worker -Q gpu0``) and its delivery settings.

Why these settings (Celery 5.7 / kombu 5.7; the design in docs/design.md and docs/delivery.md):
- prefork pool: the main process keeps heartbeats, remote control and lease renewal alive
  while a batch runs; ``solo`` would freeze them and ``threads`` cannot cancel a task.
- ``worker_concurrency = batches_per_gpu`` (8): the most batches a worker may hold. How many
  it holds at a time is the elastic hold's (workers/delivery/hold.py, its consumer step in
  workers/wiring/hold_step.py): one more only while those held have nothing left to send.
- acks late + reject on worker lost + prefetch 1: a batch is acked only after its results are
  in the store; a killed pool child puts its batch straight back.
- queues: batches go to the shared queue ``gpu``; each worker also consumes its own ``gpuN``
  first (``queue_order_strategy=priority``), so work flows to whichever GPU is free and a dead
  GPU strands nothing, while ``gpuN`` still lets a batch be pinned.
- the lease: ``visibility_timeout`` is short (30 s) because live workers renew it
  (workers/delivery/lease.py); the sweep runs every ``sweep_interval_s``, and its mutex expires soon
  after, so a worker that dies mid-sweep does not stop the others' sweeps for minutes.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from config.settings import Settings, broker_url, load_settings
from workers.node.queues import BATCH_TASK, SHARED_QUEUE, SINK_QUEUE, SINK_TASK


def celery_config(s: Settings) -> dict[str, object]:
    """Celery settings derived from the fleet settings."""
    transport = {
        "visibility_timeout": s.visibility_timeout_s,
        "queue_order_strategy": "priority",
        "unacked_restore_interval": s.sweep_interval_s,
        "unacked_restore_throttle": 1,
        # The sweep's mutex (kombu.transport.redis.QoS.restore_visible) outlives a worker that
        # dies holding it by this long: kombu's 300 s would stop every sweep for 5 minutes.
        "unacked_mutex_expire": max(int(s.sweep_interval_s * 2), 10),
        "socket_timeout": 30,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "health_check_interval": 25,
    }
    return {
        "broker_url": broker_url(s.redis_url.get_secret_value()),
        "broker_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "task_time_limit": s.task_time_limit_s,
        "worker_prefetch_multiplier": 1,
        "worker_concurrency": s.batches_per_gpu,
        "worker_pool": "prefork",
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_track_started": True,
        "task_default_queue": SHARED_QUEUE,
        "task_queues": [Queue(SHARED_QUEUE), Queue(SINK_QUEUE)],
        "task_routes": {BATCH_TASK: {"queue": SHARED_QUEUE},
                        SINK_TASK: {"queue": SINK_QUEUE}},
        "worker_hijack_root_logger": True,
    }


def make_app(settings: Settings | None = None) -> Celery:
    """Build the Celery app with the fleet's settings and tasks."""
    app = Celery("workers")
    app.conf.update(celery_config(settings or load_settings()))
    app.conf.imports = (
        "workers.wiring.tasks",
        "workers.wiring.signals",
        "workers.wiring.control",
        "workers.wiring.sink_task",
    )
    return app
