"""The simulator admits no more than SGLang 0.5.11's ``PrefillAdder`` does.

``add_one_req`` charges a request it is about to admit its prompt, its whole remaining output
budget clipped to 4,096 (no new-token ratio) and a page, and refuses it when that is ``>=``
what is left: the pool, less what is held, less ``new_token_ratio`` x the clipped remaining
budget of each running request, less the whole clipped budget (prompt + output + page) of each
request admitted earlier in the same round (``_update_prefill_budget``). The expected counts
below are worked out by hand from those lines, not by calling the code under test.
"""

from __future__ import annotations

import math

import pytest

from workers.sim.engine import SimEngine
from workers.sim.records import EngineConfig, SimRequest


class _Quiet:
    """An observer that records nothing (the scheduler's bookkeeping only)."""

    def __getattr__(self, name: str):  # noqa: ANN204 - any on_* hook
        return lambda *args, **kwargs: None


def _engine(pool: int, cap: int = 1000) -> SimEngine:
    config = EngineConfig(max_running_requests=cap, max_total_num_tokens=pool,
                          max_prefill_tokens=10**9, max_mamba_cache_size=0, mamba_ratio=0,
                          draft_tokens=0, speed=1.0, decode_log_interval=40, eos_token_id=0)
    return SimEngine(config, _Quiet())


def _request(i: int, prompt: int, max_new: int) -> SimRequest:
    return SimRequest(rid=f"r{i}", input_len=prompt, max_new_tokens=max_new, drawn_len=max_new)


@pytest.mark.parametrize(("pool", "prompt", "max_new"), [
    (1000, 100, 1000),    # 100 + 1000 + 1 = 1101 >= 1000: refused (0.7 x 1000 + 100 would fit)
    (1101, 100, 1000),    # equal is refused too
    (1102, 100, 1000),    # one more token: admitted
    (20_000, 500, 9000),  # the output budget is clipped at 4,096: 500 + 4096 + 1 = 4597
])
def test_a_lone_request_is_charged_its_whole_clipped_budget(pool: int, prompt: int,
                                                            max_new: int) -> None:
    engine = _engine(pool)
    expected = prompt + min(max_new, 4096) + 1 < pool
    assert engine._fits(_request(0, prompt, max_new), 0.0) is expected


@pytest.mark.parametrize("pool", [10_000, 50_000, 123_457])
def test_one_round_admits_what_the_prefill_adder_admits(pool: int) -> None:
    """Identical requests arriving together: each admitted one keeps prompt + budget + page
    aside, so the round stops at the largest n with n * (p + m + 1) < pool ... by hand."""
    prompt, max_new = 200, 1800
    engine = _engine(pool)
    for i in range(100):
        engine.waiting.append(_request(i, prompt, max_new))
        engine.waiting_tokens += prompt
    engine._admit()
    per = prompt + max_new + 1
    # The k-th newcomer (k admitted before it) needs per < pool - k * per (prompts held,
    # budgets kept aside), i.e. (k + 1) * per < pool.
    assert len(engine.running) == math.ceil(pool / per) - 1


def test_a_rounds_newcomers_join_the_running_batch_once_their_prefill_has_run() -> None:
    """SGLang runs a round's prefill as a forward of its own and merges it into the running
    batch in the next iteration, so during that forward ``/v1/loads`` and the gauges count
    only the requests that were running before: a finished request's slot stays empty for it."""
    import dataclasses
    import time

    engine = _engine(10**6, cap=4)
    # A slow clock: the prefill forward lasts seconds, a window wide enough to look into.
    engine.config = dataclasses.replace(engine.config, speed=1e-3)
    for i in range(3):
        engine._start(_request(i, 10, 1000))
    engine.waiting.append(_request(9, 10, 1000))
    engine.waiting_tokens += 10
    engine._admit()
    assert len(engine.running) == 4 and engine.snapshot().running == 3
    assert engine.snapshot().queued == 0  # taken off the queue: it is being prefilled
    engine._prefilling = (engine._prefilling[0], time.monotonic())  # the forward has run
    assert engine.snapshot().running == 4
