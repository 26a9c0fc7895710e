"""The simulated scheduler: one asyncio task, FCFS, continuous batching under SGLang's caps.

Caps come from :mod:`workers.engine.capacity` (SGLang's arithmetic): at most
``max_running_requests``
requests decode at once, and admission is SGLang's optimistic one (``PrefillAdder``): a request
is admitted when its prefill plus its remaining output budget times ``new_token_ratio`` fits the
KV pool next to what the running requests hold and are budgeted for. The ratio decays every
decode step; when a decode step would not fit, requests are retracted (``retract_decode``:
fewest output tokens first, then longest prompt), go back to the queue, and the ratio is
re-estimated. A prefill round also stops at ``--max-prefill-tokens`` of new input, like
``PrefillAdder``. Step and prefill times come from a measured calibration
(:mod:`workers.sim.calibration`, FLEET_SIM_CALIBRATION).

Cost per step is O(running): each running request gains the accept length as a float, and no
work is done per token. With nothing to do, the task sleeps on an event instead of polling.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import deque
from typing import Any

from workers.engine.admission import (
    NewTokenRatio,
    admission_tokens,
    admitted_offset,
    newcomer_tokens,
)
from workers.sim.pacing import (
    accept_length,
    clamp_max_new_tokens,
    sleep_until,
    step_seconds,
    steps_due,
)
from workers.sim.radix import PrefixCache, mamba_slots_held
from workers.sim.records import EngineConfig, Interval, Observer, SimRequest, Snapshot

__all__ = ["EngineConfig", "Interval", "Observer", "SimEngine", "SimRequest", "Snapshot",
           "accept_length", "clamp_max_new_tokens"]

class SimEngine:
    """FCFS continuous-batching scheduler of the simulator."""

    def __init__(self, config: EngineConfig, observer: Observer) -> None:
        self.config = config
        self.observer = observer
        self.accept_len = accept_length(config.draft_tokens, config.calibration)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.kv_used = 0  # KV tokens the running requests hold
        self.waiting_tokens = 0  # tokens the waiting requests will prefill
        self.ratio = NewTokenRatio.from_conservativeness(config.schedule_conservativeness)
        self.active = 0  # running requests that make progress (not hung)
        self.decode_steps = 0
        self.last_gen_throughput = 0.0
        self.lifetime_tokens = 0
        self.lifetime_req_steps = 0
        self._wake = asyncio.Event()
        self._output: asyncio.Event | None = None
        self._next_at = time.monotonic()
        self._interval_tokens = 0
        self._interval_req_steps = 0
        self._interval_start = time.monotonic()
        self._steps = 1  # decode steps run by the current pass
        self._prefill_s = 0.0  # real seconds the last admission round's prefill costs
        self._pass = 0  # scheduler passes run (a pass: decode steps, then an admission round)
        # (newcomers, until): the round's requests join the running batch when the pass that
        # admitted them has run, its decode steps and their prefill (see snapshot)
        self._prefilling: tuple[int, float] = (0, 0.0)
        # (pass, request): finished requests holding their slot until that pass (_decode_step)
        self._freeing: list[tuple[int, SimRequest]] = []
        self.cache = PrefixCache(config.cache_mode, config.max_total_num_tokens)

    # --- public API -----------------------------------------------------------------------

    def submit(self, req: SimRequest) -> asyncio.Future[SimRequest]:
        """Queue ``req``; the future resolves with it once finished."""
        req.future = asyncio.get_running_loop().create_future()
        self.waiting.append(req)
        self.waiting_tokens += req.held
        self._wake.set()
        return req.future

    def abort(self, rid: str | None) -> int:
        """Abort one request by id, or all when ``rid`` is None; returns how many."""
        victims = [r for r in (*self.waiting, *self.running) if rid is None or r.rid == rid]
        for req in victims:
            message = f"Abort request {req.rid}"
            reason = {"type": "abort", "message": message, "status_code": 400, "err_type": None}
            self._finish(req, reason)
        if victims:
            self.waiting = deque(r for r in self.waiting if r.finish_reason is None)
            self.waiting_tokens = sum(r.held for r in self.waiting)
            self.running = [r for r in self.running if r.finish_reason is None]
            self._wake.set()
        return len(victims)

    async def wait_output(self, timeout: float) -> bool:
        """Wait until some step produces output; False after ``timeout`` seconds."""
        if self._output is None:
            self._output = asyncio.Event()
        try:
            await asyncio.wait_for(self._output.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def snapshot(self) -> Snapshot:
        """Current usage, computed in O(running)."""
        cfg = self.config
        used = sum(r.input_len + r.generated for r in self.running)
        strategy = cfg.cache_mode.hybrid_strategy
        mamba_num = min(sum(mamba_slots_held(cfg.mamba_ratio, strategy, cfg.mamba_cache_chunk,
                                             r.input_len) for r in self.running),
                        cfg.max_mamba_cache_size) if cfg.mamba_ratio else 0
        slots = max(cfg.max_mamba_cache_size, 1)
        # A round's prefill is a forward of its own, after the pass's decode steps; its requests
        # join the running batch at the next iteration (``get_next_batch_to_run`` merges
        # ``last_batch`` first), so until then ``/v1/loads`` and the logs do not count them.
        newcomers, until = self._prefilling
        prefilling = newcomers if time.monotonic() < until else 0
        return Snapshot(
            running=self._batch_size() - prefilling,
            queued=len(self.waiting),
            used_tokens=used,
            full_usage=used / cfg.max_total_num_tokens,
            mamba_num=mamba_num if cfg.mamba_ratio else 0,
            mamba_usage=mamba_num / slots if cfg.mamba_ratio else 0.0,
            pending_tokens=self.waiting_tokens,
            total_tokens=cfg.max_total_num_tokens,
            new_token_ratio=self.ratio.value,
        )

    def _batch_size(self) -> int:
        """``len(running_batch.reqs)`` (``get_new_batch_prefill``, ``get_loads``)."""
        return len(self.running) + len(self._freeing)

    def avg_accept_length(self) -> float:
        """Lifetime accept length (tokens per request-step)."""
        return self.lifetime_tokens / self.lifetime_req_steps if self.lifetime_req_steps else 0.0

    async def run(self) -> None:
        """The scheduler loop (run it as one task)."""
        while True:
            if not self._has_work():
                await self._sleep_until_work()
                continue
            self._decode_step()
            self._admit()
            await self._pace()

    # --- scheduling -------------------------------------------------------------------------

    def _has_work(self) -> bool:
        """Whether a step would make progress."""
        return (self.active > 0 or bool(self._freeing)
                or (bool(self.waiting) and self._fits(self.waiting[0], 0.0)))

    def _budgeted(self) -> float:
        """Output tokens the running requests are budgeted for (remaining x ratio)."""
        return sum(admission_tokens(0, r.remaining, self.ratio.value) for r in self.running)

    def _fits(self, req: SimRequest, budgeted: float) -> bool:
        """Whether ``req`` can be admitted now: the running cap and ``PrefillAdder.add_one_req``
        (0.5.11), which charges a newcomer its prompt, its whole clipped output budget and a
        page, refused when that is ``>=`` the pool less what is held and ``budgeted``."""
        if self._batch_size() >= self.config.max_running_requests:
            return False
        need = newcomer_tokens(req.held, req.remaining)
        return need < self.config.max_total_num_tokens - self.kv_used - budgeted

    async def _sleep_until_work(self) -> None:
        """Block on the wake event (new request or abort) instead of polling."""
        if not self.running and not self.waiting:
            self.last_gen_throughput = 0.0
            self.observer.on_idle(self.snapshot())
        self._wake.clear()
        await self._wake.wait()
        self._next_at = time.monotonic()
        self._interval_start = time.monotonic()
        self._interval_tokens = self._interval_req_steps = 0

    def _admit(self) -> None:
        """One prefill round: admit FCFS while the caps and the prefill budget allow.

        The budget (``--max-prefill-tokens``, ``PrefillAdder.rem_input_tokens``) counts the
        tokens to compute: a radix-cache hit costs neither budget nor prefill time.
        """
        new_reqs = new_tokens = cached = squares = 0
        running_before = len(self.running)
        budgeted = self._budgeted()
        # A round's requests match the radix tree as it was before the round: their prompts
        # enter the tree only once the prefill forward ran (SGLang inserts them in
        # ``Scheduler.process_batch_result_prefill`` through ``tree_cache.cache_unfinished_req``),
        # so two copies of one prompt admitted together both compute it.
        inserted: list[tuple[int, ...]] = []
        while self.waiting and self._fits(self.waiting[0], budgeted):
            req = self.waiting[0]
            hit = self.cache.match(req.prefix, req.input_len)
            compute = req.held - hit  # a retracted request recomputes its output so far
            if new_reqs and new_tokens + compute > self.config.max_prefill_tokens:
                break
            # _update_prefill_budget: the round's admitted requests keep their whole budget
            # aside (their prompt is held from _start on, in kv_used).
            budgeted += admitted_offset(req.max_new_tokens)
            self.waiting.popleft()
            self.waiting_tokens -= req.held
            req.cached_tokens = hit
            inserted.append(req.prefix)
            new_reqs += 1
            new_tokens += compute
            squares += compute * compute
            cached += hit
            self._start(req)
        for prefix in inserted:
            self.cache.insert(prefix)
        if new_reqs:
            self.running = [r for r in self.running if r.finish_reason is None]
            cal = self.config.calibration
            self._prefill_s = cal.prefill_s(new_tokens, squares) / self.config.speed
            newcomers = max(0, len(self.running) - running_before)  # those still running
            self._prefilling = (newcomers, math.inf)  # until the pass's end (_pace)
            self.observer.on_step(0, new_tokens, cached)
            snap = self.snapshot()
            self.observer.on_prefill(new_reqs, new_tokens, cached, running_before, snap)
            self._signal_output()

    def _start(self, req: SimRequest) -> None:
        """Admit ``req``: prefill produces its first token."""
        if req.crash:
            self.observer.on_crash(req)
            os._exit(1)  # sim fault injection: a poison prompt kills the engine
        self.running.append(req)
        req.admitted = True
        req.admitted_at = req.admitted_at or time.monotonic()
        if req.hang:
            self.kv_used += req.held
            return  # sim fault injection: admitted, holds its slot, never advances
        self.active += 1
        req.progress = max(req.progress, 1.0)
        req.generated = max(req.generated, min(1, req.stop_at))
        self.kv_used += req.held
        if req.generated >= req.stop_at:
            self._complete(req)

    def _step_seconds(self) -> float:
        """Real seconds of one decode step at the current batch size and speed."""
        return step_seconds(self.config.calibration, len(self.running), self.kv_used,
                            self.config.draft_tokens > 0, self.config.speed)

    def _steps_now(self) -> int:
        """Decode steps to run in this pass (:func:`workers.sim.pacing.steps_due`)."""
        return steps_due(self._next_at, self._step_seconds(), self.running, self.accept_len)

    def _decode_step(self) -> None:
        """Advance every running request by ``k`` steps of the accept length (O(running)).

        A request that finishes here keeps its slot through this pass's admission round, and
        under the overlap scheduler through the next pass's too. ``get_new_batch_prefill`` counts
        ``len(running_batch.reqs)``, which still holds it until ``update_running_batch``
        filters it while building the next decode batch; ``event_loop_overlap`` processes a
        batch's results only once the next batch has been launched, so that batch still
        carries it (0.5.11 ``scheduler.py``).
        """
        self._pass += 1
        if self._freeing:
            self._freeing = [(p, r) for p, r in self._freeing if p > self._pass]
        if not self.active:
            self._steps = 1
            return
        steps = self._steps = self._steps_now()
        self._make_room(steps)
        gain = self.accept_len * steps
        produced = req_steps = 0
        done = False
        for req in self.running:
            if req.hang:
                continue
            req.progress += gain
            new = min(int(req.progress), req.stop_at)
            produced += new - req.generated
            self.kv_used += new - req.generated
            req.generated = new
            req.verify_ct += steps
            req_steps += steps
            if new >= req.stop_at:
                self._complete(req)
                done = True
        self._account(produced, req_steps, steps)  # logs see the batch that ran, as SGLang's
        if done:
            free_at = self._pass + 1 + self.config.overlap_schedule
            self._freeing += [(free_at, r) for r in self.running if r.finish_reason is not None]
            self.running = [r for r in self.running if r.finish_reason is None]

    def _make_room(self, steps: int) -> None:
        """``Scheduler.update_running_batch``: retract requests when the next decode steps'
        tokens do not fit the KV pool (``ScheduleBatch.retract_decode``), else decay the ratio.

        Each running request takes what the steps produce plus ``max(draft tokens, 1)`` slots.
        """
        per_req = math.ceil(self.accept_len * steps) + max(self.config.draft_tokens, 1)
        limit = self.config.max_total_num_tokens
        if self.kv_used + self.active * per_req <= limit or self.active <= 1:
            self.ratio.decode_steps(steps)
            return
        victims = sorted((r for r in self.running if not r.hang),
                         key=lambda r: (r.generated, -r.input_len), reverse=True)
        retracted: list[SimRequest] = []
        while victims and len(victims) > 1 and self.kv_used + self.active * per_req > limit:
            req = victims.pop()
            self._retract(req)
            retracted.append(req)
        old = self.ratio.value
        decoded = sum(r.generated for r in self.running)
        budget = sum(r.max_new_tokens for r in self.running)
        self.ratio.after_retract(decoded, budget, len(self.running))
        self.waiting.extendleft(reversed(retracted))
        self.waiting_tokens += sum(r.held for r in retracted)
        self.observer.on_retract(len(retracted), old, self.ratio.value)

    def _retract(self, req: SimRequest) -> None:
        """Free ``req``'s KV and take it out of the batch; it keeps its output so far."""
        self.running.remove(req)
        self.kv_used -= req.held
        self.active -= 1
        req.admitted = False
        req.retractions += 1

    def _account(self, produced: int, req_steps: int, steps: int) -> None:
        """Update counters after decode steps; report every ``decode_log_interval`` steps."""
        before = self.decode_steps
        self.decode_steps += steps
        self._interval_tokens += produced
        self._interval_req_steps += req_steps
        self.lifetime_tokens += produced
        self.lifetime_req_steps += req_steps
        self.observer.on_step(produced, 0)
        if produced:
            self._signal_output()
        interval = self.config.decode_log_interval
        if self.decode_steps // interval != before // interval:
            self.observer.on_decode_interval(self.snapshot(), self._close_interval())

    def _close_interval(self) -> Interval:
        """Statistics since the previous interval, then reset them."""
        now = time.monotonic()
        elapsed = max(now - self._interval_start, 1e-9)
        tokens, steps = self._interval_tokens, self._interval_req_steps
        self.last_gen_throughput = tokens / elapsed
        accept = tokens / steps if steps else 0.0
        drafts = self.config.draft_tokens
        # 0.5.11: accept rate = (accepted - steps) / (steps * (draft_tokens - 1)).
        rate = (tokens - steps) / (steps * (drafts - 1)) if steps and drafts > 1 else 0.0
        self._interval_start, self._interval_tokens, self._interval_req_steps = now, 0, 0
        return Interval(self.last_gen_throughput, accept, rate)

    async def _pace(self) -> None:
        """Sleep until the next step is due (step time divided by FLEET_SIM_SPEED)."""
        self._next_at += self._steps * self._step_seconds() + self._prefill_s
        self._prefill_s = 0.0
        if self._prefilling[1] == math.inf:
            self._prefilling = (self._prefilling[0], self._next_at)
        self._next_at = await sleep_until(self._next_at)

    # --- finishing --------------------------------------------------------------------------

    def _complete(self, req: SimRequest) -> None:
        """Finish ``req`` normally: EOS (stop) or its max_new_tokens budget (length)."""
        if req.drawn_len <= req.max_new_tokens:
            reason: dict[str, Any] = {"type": "stop", "matched": self.config.eos_token_id}
        else:
            reason = {"type": "length", "length": req.max_new_tokens}
        self._finish(req, reason)

    def _finish(self, req: SimRequest, reason: dict[str, Any]) -> None:
        """Release ``req``'s resources and resolve its future (caller prunes the lists)."""
        if req.finish_reason is not None:
            return
        if req.admitted:
            self.kv_used -= req.held
            if not req.hang:
                self.active -= 1
        req.finish_reason = reason
        req.finished_at = time.monotonic()
        if req.future is not None and not req.future.done():
            req.future.set_result(req)
        if not req.internal:
            self.observer.on_finish(req)

    def _signal_output(self) -> None:
        """Wake health probes waiting for any scheduler output."""
        if self._output is not None:
            self._output.set()
            self._output = None

