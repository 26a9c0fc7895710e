"""Celery wiring: the app, its signals and worker bootstep, the tasks, and the worker's runtime."""
