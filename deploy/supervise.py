"""Start one fleet process after a delay and, optionally, restart it when it fails.

Usage: ``python -m deploy.supervise [--delay S] [--restart] -- COMMAND ...``

- ``--delay S`` waits ``S`` seconds before the first start, so seven engines do not load a
  54 GB model from the same disk at the same moment (the generators give GPU N a delay of
  N x stagger).
- Without ``--restart`` the command replaces this process (``exec``): in a container the
  command is then PID 1's child under ``init`` and Docker's restart policy supervises it.
- With ``--restart`` (the Procfile, where honcho restarts nothing and stops every process
  when one exits): a command that fails (non-zero exit or killed by a signal) is started
  again after a backoff; one that exits 0 (a warm shutdown the operator asked for, e.g. a
  GPU drained for maintenance) is held: not restarted until this process gets SIGHUP.
  SIGTERM and SIGINT are passed to the command and end supervision.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

BACKOFF_START_S = 2.0
BACKOFF_MAX_S = 60.0
# A run that lasted this long resets the backoff: the process was healthy, not crash-looping.
HEALTHY_RUN_S = 300.0


def _say(msg: str) -> None:
    print(f"supervise[{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


class Supervisor:
    """Runs one command, restarts it on failure, holds it after a clean exit."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.wake = threading.Event()

    def __repr__(self) -> str:
        pid = self.child.pid if self.child else None
        return f"<Supervisor {self.argv[0]} pid={pid} stopping={self.stopping}>"

    def on_stop(self, signum: int, _frame: FrameType | None) -> None:
        """SIGTERM/SIGINT: pass the signal on and stop supervising."""
        self.stopping = True
        self.wake.set()
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def on_hup(self, _signum: int, _frame: FrameType | None) -> None:
        """SIGHUP: start a held command again."""
        self.wake.set()

    def run_once(self) -> int:
        """Run the command to its end; its exit code (negative: killed by that signal)."""
        self.child = subprocess.Popen(self.argv)
        _say(f"started {' '.join(self.argv)} (pid {self.child.pid})")
        return self.child.wait()

    def hold(self) -> None:
        """Wait for SIGHUP (start again) or SIGTERM/SIGINT (stop)."""
        _say(f"command exited cleanly; not restarted. Start it again: kill -HUP {os.getpid()}")
        self.wake.clear()
        while not self.wake.wait(3600):
            pass

    def loop(self) -> int:
        """Supervise until told to stop; return the last exit code."""
        backoff = BACKOFF_START_S
        code = 0
        while not self.stopping:
            started = time.monotonic()
            code = self.run_once()
            if self.stopping:
                break
            if code == 0:
                self.hold()
                backoff = BACKOFF_START_S
                continue
            if time.monotonic() - started >= HEALTHY_RUN_S:
                backoff = BACKOFF_START_S
            _say(f"command failed with {code}; restarting in {backoff:.0f} s")
            self.wake.clear()
            self.wake.wait(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
        return code if code >= 0 else 128 - code


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line: options, then ``--`` and the command."""
    p = argparse.ArgumentParser(prog="python -m deploy.supervise",
                                description=__doc__.splitlines()[0])
    p.add_argument("--delay", type=float, default=0.0, help="seconds before the first start")
    p.add_argument("--restart", action="store_true", help="restart the command when it fails")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    ns = p.parse_args(argv)
    if ns.command[:1] == ["--"]:
        ns.command = ns.command[1:]
    if not ns.command:
        p.error("no command given (put it after --)")
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    ns = parse(sys.argv[1:] if argv is None else argv)
    sup = Supervisor(ns.command)
    signal.signal(signal.SIGTERM, sup.on_stop)
    signal.signal(signal.SIGINT, sup.on_stop)
    signal.signal(signal.SIGHUP, sup.on_hup)
    if ns.delay > 0:
        _say(f"waiting {ns.delay:.0f} s before starting (staggered start)")
        sup.wake.wait(ns.delay)
        if sup.stopping:
            return 0
    if not ns.restart:
        os.execvp(ns.command[0], ns.command)
    return sup.loop()


if __name__ == "__main__":
    sys.exit(main())
