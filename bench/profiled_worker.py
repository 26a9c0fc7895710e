"""``celery`` with cProfile in every pool child: ``python -m bench.profiled_worker -A workers ...``.

Each prefork child starts a profiler on the CPU clock when it is forked
(``worker_process_init``) and writes ``$BENCH_PROFILE_DIR/child-<pid>.prof`` after every task,
so the stats survive however the child ends. Used by :mod:`bench.overhead` to say where a
worker's CPU time goes.
"""

from __future__ import annotations

import cProfile
import os
import sys
import time
from pathlib import Path
from typing import Any

from celery import signals

_profiler: cProfile.Profile | None = None


@signals.worker_process_init.connect
def _start(**_: Any) -> None:
    """Profile this pool child from its first task on."""
    global _profiler
    _profiler = cProfile.Profile(time.process_time)  # CPU time: waiting in epoll is not work
    _profiler.enable()


@signals.task_postrun.connect
def _dump(**_: Any) -> None:
    """Write this child's stats so far (dump_stats disables the profiler: turn it back on)."""
    if _profiler is None:
        return
    out = Path(os.environ["BENCH_PROFILE_DIR"]) / f"child-{os.getpid()}.prof"
    _profiler.dump_stats(out)
    _profiler.enable()


def main() -> None:
    """Run the celery command line with the hooks above connected."""
    from celery.__main__ import main as celery_main

    sys.argv = ["celery", *sys.argv[1:]]
    celery_main()


if __name__ == "__main__":
    main()
