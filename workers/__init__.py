"""GPU workers: the Celery app, the engine each worker owns, and the batch task.

``celery -A workers`` finds the app as ``workers.app``; it is built on first access so that
``python -m workers.sim`` (an engine, restarted often) does not pay for importing Celery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery import Celery

_app: Celery | None = None


def get_app() -> Celery:
    """The fleet's Celery app (built once per process)."""
    global _app
    if _app is None:
        from workers.wiring.celery_app import make_app
        from workers.wiring.hold_step import HoldStep
        from workers.wiring.signals import EngineStep

        _app = make_app()
        _app.steps["worker"].add(EngineStep)
        _app.steps["consumer"].add(HoldStep)
    return _app


def __getattr__(name: str) -> Any:
    if name == "app":
        return get_app()
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
