"""The GPU check's tuner phase: `fleet tune diagnose` and `fleet tune auto` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from bench.common import Fleet


def tune_json(fleet: Fleet, *args: str, timeout_s: float) -> dict[str, Any]:
    """``fleet tune ARGS --json`` as a user runs it; its JSON, or the error it printed."""
    # Its log goes to a file beside the workers' as it runs: a run cut by the call's time limit
    # keeps how far the tuner got.
    log = fleet.workdir / "logs" / f"tune-{args[0]}.log"
    with log.open("a") as err:
        res = subprocess.run([sys.executable, "-m", "producer", "tune", *args, "--json"],
                             env=fleet.env(), stdout=subprocess.PIPE, stderr=err, text=True,
                             timeout=timeout_s)
    try:
        return dict(json.loads(res.stdout))
    except json.JSONDecodeError:
        return {"error": (res.stdout or log.read_text())[-1500:]}


def tune_auto(fleet: Fleet, window_s: float) -> dict[str, Any]:
    """``fleet tune auto`` on GPU 0 while the job runs; its report."""
    return {"tune_auto": tune_json(fleet, "auto", "--canary", "gpu0", "--max-trials", "1",
                                   "--window-s", str(window_s), "--settle-timeout-s", "240",
                                   "--restart-timeout-s", "600", timeout_s=1500)}


def diagnose(fleet: Fleet, gpu: int) -> dict[str, Any]:
    """``fleet tune diagnose --gpu N`` on the live engine."""
    return tune_json(fleet, "diagnose", "--gpu", str(gpu), timeout_s=300)
