"""Process-group guard for one engine: ``python -m workers.engine.guard PARENT_PID -- ARGV…``.

SGLang forks scheduler and detokenizer processes; a parent-death signal on the server alone
would orphan them. The guard leads its own process group, runs the engine inside it, and
takes the whole group down when the worker that started it goes away, even after a SIGKILL
of the worker (Linux ``PR_SET_PDEATHSIG``), or when asked to stop (SIGTERM).

Two traps: Linux sends the parent-death signal when the *thread* that spawned the guard ends,
not the process, so the guard's signal only makes it look (a thread of the worker may end
while the worker lives: the guard stays unless its parent process is really gone); and the
engine itself gets SIGKILL as its parent-death signal, so a SIGKILL of the guard (which runs
no clean-up) still takes the engine down. SGLang's own subprocesses follow their parent the
same way (``kill_itself_when_parent_died`` in ``sglang.srt.utils``, called by its scheduler
and detokenizer processes).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
GRACE_S = float(os.environ.get("FLEET_ENGINE_STOP_GRACE_S", "30"))


def _set_parent_death_signal(sig: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:  # not Linux: fall back to polling the parent pid
        pass


def _die_with_guard() -> None:
    """In the engine's process, before exec: SIGKILL it when the guard dies."""
    _set_parent_death_signal(signal.SIGKILL)


def _take_down_group(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM the group, wait the grace period, then SIGKILL whatever is left."""
    pgid = os.getpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)  # also ends the guard itself


def main(argv: list[str]) -> int:
    """Run the engine argv under the guard; exit with the engine's exit code."""
    parent_pid, engine_argv = int(argv[0]), argv[2:]
    _set_parent_death_signal(signal.SIGUSR1)
    stopping = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    def on_parent_thread_gone(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = stopping or os.getppid() != parent_pid

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGUSR1, on_parent_thread_gone)
    child = subprocess.Popen(engine_argv, preexec_fn=_die_with_guard)  # noqa: PLW1509
    while True:
        if stopping or os.getppid() != parent_pid:
            _take_down_group(child)
        code = child.poll()
        if code is not None:
            # The engine is gone; make sure none of its own children outlive it.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.killpg(os.getpgrp(), signal.SIGTERM)
            return code
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
