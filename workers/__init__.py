"""GPU workers: the Celery app, the engine each worker owns, and the batch task."""

from workers.app import make_app
from workers.signals import EngineStep

app = make_app()
app.steps["worker"].add(EngineStep)

__all__ = ["app"]
