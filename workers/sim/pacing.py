"""The simulator's clock: how long a decode step takes, how many steps are due now, and the
sleep until the next one (step time divided by FLEET_SIM_SPEED).

Pure arithmetic beside :class:`workers.sim.engine.SimEngine`, which owns the state: step times
come from the measured calibration (:mod:`workers.sim.calibration`), and a sim that falls
behind its schedule by more than MAX_LAG_S stops trying to catch up.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable

from workers.sim.calibration import B200_WORKLOAD, Calibration
from workers.sim.records import SimRequest

# When the sim falls behind its schedule by more than this, it stops trying to catch up.
MAX_LAG_S = 0.05
# Upper bound of decode steps run in one pass at very high FLEET_SIM_SPEED.
MAX_STEPS_PER_PASS = 10_000


def accept_length(draft_tokens: int, cal: Calibration = B200_WORKLOAD) -> float:
    """Tokens gained per decode step: 1 + rate * (draft - 1), or 1 without speculation."""
    if draft_tokens <= 1:
        return 1.0
    return 1.0 + cal.accept_rate * (draft_tokens - 1)


def step_seconds(cal: Calibration, running: int, kv_used: float, speculative: bool,
                 speed: float) -> float:
    """Real seconds of one decode step of ``running`` requests holding ``kv_used`` tokens."""
    context = kv_used / running if running else 0.0
    return cal.step_ms(running, context, speculative) / 1000.0 / speed


def steps_due(next_at: float, step_s: float, running: Iterable[SimRequest],
              accept_len: float) -> int:
    """Decode steps to run in this pass: those already due, but none past a finish.

    At real speed this is 1. When FLEET_SIM_SPEED makes steps shorter than one event-loop
    pass, every step that is due runs in one O(running) pass, stopping at the first step
    where a request finishes so that its slot is refilled at the same step as in SGLang.
    """
    due = 1 + int(max(0.0, time.monotonic() - next_at) / step_s)
    if due == 1:
        return 1
    to_finish = min((math.ceil((r.stop_at - r.progress) / accept_len)
                     for r in running if not r.hang), default=1)
    return max(1, min(due, to_finish, MAX_STEPS_PER_PASS))


async def sleep_until(next_at: float) -> float:
    """Sleep until ``next_at`` (monotonic); return the schedule to keep (reset to now when
    the sim lags by more than MAX_LAG_S)."""
    delay = next_at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
        return next_at
    if delay < -MAX_LAG_S:
        next_at = time.monotonic()
    await asyncio.sleep(0)
    return next_at


def clamp_max_new_tokens(requested: int | None, input_len: int, max_req_len: int) -> int:
    """``Scheduler.init_req_max_new_tokens``: min(requested, max_req_len - input_len - 1)."""
    limit = max(0, max_req_len - input_len - 1)
    return limit if requested is None else max(0, min(requested, limit))
