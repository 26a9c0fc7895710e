"""The tuner: snapshot an engine, name its binding constraint, re-tune one GPU at a time.

Modules, one job each: ``gpu`` (NVML), ``engine_log`` / ``engine_metrics`` (SGLang's log lines
and /metrics), ``readings`` (named values with their sources), ``snapshot`` (capture, load,
save), ``memory_model`` (workers.engine.capacity calibrated from the engine), ``throughput`` (tok/s
versus running requests), ``levers`` / ``recommend`` / ``diagnose`` (constraint and advice),
``plan``, ``fleet`` (heartbeats, engine HTTP, Celery remote control), ``apply`` / ``auto``
(canary, keep or roll back, roll out), ``cli``.
"""
