"""Occupancy from an SGLang server's own log: its scheduler's running-request lines.

SGLang's scheduler logs a ``Decode batch, #running-req: N, ...`` line every
``--decode-log-interval`` decode steps (40 by default; ``scheduler_metrics_mixin.
log_decode_stats``) and a ``Prefill batch, ... #running-req: N, #queue-req: Q`` line for each
prefill batch (``log_prefill_stats``). Each decode line stands for the same number of steps, so
the mean ``#running-req`` of the decode lines over the cap is the engine's occupancy per step,
read the same way for the fleet's engines and for SGLang's offline ``Engine`` (the GPU check's
anchor), whose client is not sampled over HTTP. That tells the engine's own churn (requests
finishing and the next prefilled) apart from the fleet's.

Windows:
- the fleet's job: the lines between the job's first enqueue and its end (wall clock; the
  log's stamps are the machine's local time, second resolution);
- the anchor: from its main run's first line with a queue (``#queue-req`` > 0: every row is
  handed to ``Engine.generate`` at once), which leaves out the CLI's warm-up requests and the
  server's own warm-up, to its last decode line.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LINE = re.compile(r"^\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]]*\] (?P<kind>Decode|Prefill) "
                  r"batch[.,].*?#running-req: (?P<running>\d+)")
QUEUE = re.compile(r"#queue-req: (\d+)")
NEW_SEQ = re.compile(r"#new-seq: (\d+)")
GEN_TOK_S = re.compile(r"gen throughput \(token/s\): ([\d.]+)")


@dataclass(frozen=True)
class SchedLine:
    """One running-request line of the scheduler's log."""

    at: float  # epoch seconds (local time of the log, 1 s resolution)
    kind: str  # "Decode" or "Prefill"
    running: int  # the batch's running requests (a prefill: those running before it)
    queued: int
    new_seq: int = 0
    gen_tok_s: float | None = None  # a decode line's rate over the steps since the last one


def parse(lines: Iterable[str]) -> list[SchedLine]:
    """The scheduler's running-request lines, in order."""
    out = []
    for line in lines:
        m = LINE.search(line)
        if m is None:
            continue
        q = QUEUE.search(line)
        n = NEW_SEQ.search(line)
        g = GEN_TOK_S.search(line)
        out.append(SchedLine(time.mktime(time.strptime(m["ts"], "%Y-%m-%d %H:%M:%S")),
                             m["kind"], int(m["running"]), int(q[1]) if q else 0,
                             int(n[1]) if n else 0, float(g[1]) if g else None))
    return out


def read(path: Path) -> list[SchedLine]:
    """:func:`parse` of a log file (empty when it is missing)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return parse(text.splitlines())


def occupancy(lines: list[SchedLine], cap: int) -> dict[str, Any]:
    """Mean running requests of the decode lines over ``cap`` (None without decode lines)."""
    decode = [x.running for x in lines if x.kind == "Decode"]
    if not decode or cap <= 0:
        return {"occupancy": None, "decode_lines": len(decode)}
    # While requests wait at the engine, every empty slot is the engine's own churn (a
    # finished request's slot refilled only after the next prefill forward), not the client's.
    queued = [x.running for x in lines if x.kind == "Decode" and x.queued > 0]
    return {"occupancy": round(sum(decode) / len(decode) / cap, 3),
            "decode_lines": len(decode), "mean_running": round(sum(decode) / len(decode), 1),
            "occupancy_while_queued": round(sum(queued) / len(queued) / cap, 3)
            if queued else None,
            "seconds": round(lines[-1].at - lines[0].at, 1)}


def window(lines: list[SchedLine], start: float, end: float) -> list[SchedLine]:
    """The lines stamped within [start, end] (epoch seconds; stamps are whole seconds)."""
    return [x for x in lines if start - 1 <= x.at <= end + 1]


def main_run(lines: list[SchedLine]) -> list[SchedLine]:
    """The anchor's main run: from its first line with a queue to its last decode line."""
    first = next((i for i, x in enumerate(lines) if x.queued > 0), None)
    if first is None:
        return lines
    last = max((i for i, x in enumerate(lines) if x.kind == "Decode"), default=len(lines) - 1)
    return lines[first:last + 1]


def fleet_job(path: Path, start: float, end: float, cap: int) -> dict[str, Any]:
    """The fleet job's occupancy from its engine's log."""
    return {**occupancy(window(read(path), start, end), cap), "log": path.name}


def anchor_run(path: Path, cap: int) -> dict[str, Any]:
    """The offline anchor's occupancy from its log."""
    return {**occupancy(main_run(read(path)), cap), "log": path.name}
