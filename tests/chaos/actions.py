"""Operator actions a schedule takes: the ``python -m producer`` commands a person would type,
plus deleting a result object by hand. Each returns one line (command, exit code, last line of
its output); a command that fails (the store is cut off, Redis restarting) is part of the
schedule, not an error of the harness.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.chaos.cluster import ROOT, Cluster
from tests.conftest import run_producer
from workers.dataset.jobs import batch_of_result_key, result_key, results_prefix

COMMAND_TIMEOUT_S = 120


def _said(res: subprocess.CompletedProcess[str]) -> str:
    lines = (res.stderr or res.stdout or "").strip().splitlines()
    return f"rc={res.returncode}" + (f": {lines[-1][:160]}" if lines else "")


def _producer(c: Cluster, *args: str) -> str:
    try:
        res = run_producer(c.env, *args, timeout_s=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{' '.join(args[:1])}: still running after {COMMAND_TIMEOUT_S} s (abandoned)"
    return f"{args[0]} {_said(res)}"


def pause(c: Cluster, inputs: dict[str, Path], job: str) -> str:
    """``pause --job``."""
    return _producer(c, "pause", "--job", job)


def resume(c: Cluster, inputs: dict[str, Path], job: str) -> str:
    """``resume --job``."""
    return _producer(c, "resume", "--job", job)


def cancel(c: Cluster, inputs: dict[str, Path], job: str) -> str:
    """``cancel --job``."""
    return _producer(c, "cancel", "--job", job)


def enqueue(c: Cluster, inputs: dict[str, Path], job: str) -> str:
    """``enqueue FILE --job`` again (the documented resume and reconcile)."""
    return _producer(c, "enqueue", str(inputs[job]), "--job", job)


def enqueue_interrupted(c: Cluster, inputs: dict[str, Path], job: str, after_s: float) -> str:
    """``enqueue`` stopped by Ctrl-C (SIGINT) ``after_s`` seconds in."""
    proc = subprocess.Popen([sys.executable, "-m", "producer", "enqueue", str(inputs[job]),
                             "--job", job], env=c.env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    return f"enqueue interrupted after {after_s:.2f} s: rc={code}"


def requeue_failed(c: Cluster, inputs: dict[str, Path], job: str) -> str:
    """``requeue-failed --job`` (quarantined rows back to the GPUs)."""
    return _producer(c, "requeue-failed", "--job", job)


def sink(c: Cluster, inputs: dict[str, Path], job: str) -> str:
    """``sink --job`` mid-job (queued for the sink worker; not waited for)."""
    return _producer(c, "sink", "--job", job)


def delete_result(c: Cluster, inputs: dict[str, Path], job: str, pick: int) -> str:
    """Delete one stored result object by hand (a bad file removed from the bucket)."""
    store = c.store()
    batches = sorted(b for k in store.list(results_prefix(job))
                     if (b := batch_of_result_key(k)) is not None)
    if not batches:
        return f"skipped: no result of {job} stored yet"
    batch = batches[pick % len(batches)]
    store.delete(result_key(job, batch))
    return f"deleted {result_key(job, batch)}"


ACTIONS: dict[str, Callable[..., str]] = {
    "pause": pause,
    "resume": resume,
    "cancel": cancel,
    "enqueue": enqueue,
    "enqueue_interrupted": enqueue_interrupted,
    "requeue_failed": requeue_failed,
    "sink": sink,
    "delete_result": delete_result,
}
