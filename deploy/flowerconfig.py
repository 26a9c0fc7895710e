"""Flower's shipped configuration: ``celery -A workers flower --conf=deploy/flowerconfig.py``.

Flower (tornado) executes this file after reading ``FLOWER_*`` environment variables and the
command line, and takes every global whose name is a Flower option. So:

- ``format_task`` puts prompts, output tokens and tokens/s of each batch in the Result column;
- the address defaults to 127.0.0.1 (Flower's own default is every interface);
- anywhere else Flower refuses to start without credentials: set
  ``FLOWER_BASIC_AUTH=user:password`` (comma-separated for several) or OAuth (``FLOWER_AUTH``);
  the credentials are never written here or logged.
"""

from __future__ import annotations

from tornado.options import options

from workers.observe.events import format_task

LOOPBACK = {"127.0.0.1", "localhost", "::1"}

__all__ = ["address", "format_task", "max_tasks", "tasks_columns"]

# Tasks kept in memory (flower#1305: the 100k default grows without bound on long runs).
max_tasks = 20000
tasks_columns = "name,uuid,state,args,result,received,started,runtime,worker"
# The command line and FLOWER_ADDRESS were read before this file; keep what they said.
address = options.address or "127.0.0.1"


def _check_exposure() -> None:
    """Refuse to serve beyond this machine without basic auth or OAuth."""
    if options.unix_socket or address in LOOPBACK:
        return
    if options.basic_auth or options.auth:
        return
    raise SystemExit(f"refusing to serve Flower on {address!r} without authentication: set "
                     "FLOWER_BASIC_AUTH=user:password (or bind --address=127.0.0.1)")


_check_exposure()
