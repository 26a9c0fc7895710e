"""Remote-control commands the fleet adds to Celery (``fleet_relaunch``)."""

from __future__ import annotations

from typing import Any

from celery.worker.control import control_command

from config.launch_profile import LaunchProfile
from workers import signals


@control_command(args=[("profile", dict)], signature="<profile-json>")
def fleet_relaunch(state: Any, profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """Restart this worker's engine with a new launch profile (used by the tuner)."""
    runtime = signals.current_runtime()
    if runtime is None or profile is None:
        return {"ok": False, "error": "no engine runtime in this worker or no profile given"}
    new = LaunchProfile.model_validate(profile)
    runtime.request_relaunch(new)
    return {"ok": True, "profile": new.name}
