"""Remote-control commands the fleet adds to Celery (``fleet_relaunch``).

Remote control travels through Redis like tasks do: whoever can write there can send it. The
command therefore only names a profile (see :mod:`workers.engine.relaunch_guard`); it never carries
launch flags outside the tuner's levers, nor environment variables.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery.worker.control import control_command

from workers.engine.relaunch_guard import RelaunchRefused, vet
from workers.wiring import signals

log = logging.getLogger(__name__)


@control_command(args=[("profile", dict)], signature="<profile-json>")
def fleet_relaunch(state: Any, profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """Restart this worker's engine with a profile it knows or a vetted tuner profile."""
    runtime = signals.current_runtime()
    if runtime is None or profile is None:
        return {"ok": False, "error": "no engine runtime in this worker or no profile given"}
    try:
        new = vet(profile, runtime.known_profiles())
        runtime.request_relaunch(new)  # refused where it does not fit the GPU group
    except RelaunchRefused as exc:
        log.warning("fleet_relaunch refused: %s", exc)
        return {"ok": False, "error": str(exc)}
    runtime.trust_profile(new)
    return {"ok": True, "profile": new.name}


def send_relaunch(app: Any, node: str, profile: dict[str, Any], timeout_s: float = 30.0
                  ) -> dict[str, Any] | None:
    """Send ``fleet_relaunch`` to ``node`` and return its answer (None when it gave none).

    Broadcasts go through Redis pub/sub, so one sent before the worker's control box subscribes
    is lost without a word; a worker whose heartbeat is up may not consume remote control yet.
    The node is therefore pinged until it answers, and only then sent the command, once.
    """
    deadline = time.monotonic() + timeout_s
    while not any(node in reply for reply in app.control.ping(destination=[node], timeout=1.0)
                  or []):
        if time.monotonic() >= deadline:
            return None
    replies = app.control.broadcast("fleet_relaunch", arguments={"profile": profile},
                                    destination=[node], reply=True,
                                    timeout=max(1.0, deadline - time.monotonic()))
    return next((reply[node] for reply in replies or [] if node in reply), None)
