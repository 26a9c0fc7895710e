"""SGLang's admission and retraction budget (``managers/schedule_policy.py``,
``managers/scheduler.py``): how many KV tokens a request is charged when it is admitted."""

from __future__ import annotations

from dataclasses import dataclass

# SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: the most output tokens one request is budgeted for.
CLIP_MAX_NEW_TOKENS = 4096
# global_config / environ defaults: init ratio 0.7 x --schedule-conservativeness, decaying to
# 0.14 of it over 600 decode steps; after a retraction the ratio is re-estimated with
# RETRACT_DECODE_STEPS more steps per running request.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20


@dataclass
class NewTokenRatio:
    """``Scheduler.new_token_ratio``: the share of a request's remaining output budget that
    admission reserves in the KV pool (SGLang admits optimistically and retracts when short)."""

    init: float
    floor: float
    decay: float
    value: float

    @classmethod
    def from_conservativeness(cls, conservativeness: float = 1.0) -> NewTokenRatio:
        """The scheduler's start values for ``--schedule-conservativeness``."""
        init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        floor = min(init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        return cls(init, floor, (init - floor) / NEW_TOKEN_RATIO_DECAY_STEPS, init)

    def decode_steps(self, steps: int) -> None:
        """Decay after ``steps`` decode batches without a retraction."""
        self.value = max(self.value - self.decay * steps, self.floor)

    def after_retract(self, decoded: int, max_new_total: int, running: int) -> None:
        """``ScheduleBatch.retract_decode``'s new estimate, capped at 1."""
        estimate = (decoded + RETRACT_DECODE_STEPS * running) / max(max_new_total, 1)
        self.value = min(1.0, estimate)


# PrefillAdder reserves one page per request for alloc_extend's page alignment (page size 1).
PAGE_SIZE = 1


def admission_tokens(prefill_tokens: float, remaining_output: float, ratio: float) -> float:
    """KV tokens ``PrefillAdder`` keeps aside for a request already running
    (``_get_running_request_total_token_offset``): its remaining output budget, clipped to
    CLIP_MAX_NEW_TOKENS, times the new-token ratio (plus ``prefill_tokens`` not yet held)."""
    return prefill_tokens + min(max(0, remaining_output), CLIP_MAX_NEW_TOKENS) * ratio


def newcomer_tokens(input_tokens: float, remaining_output: float) -> float:
    """What ``PrefillAdder.add_one_req`` charges a request it is about to admit (0.5.11): its
    whole prompt, its whole remaining output budget clipped to CLIP_MAX_NEW_TOKENS (no ratio)
    and a page; it is refused when that is ``>=`` what is left (``rem_total_tokens``)."""
    return input_tokens + min(max(0, remaining_output), CLIP_MAX_NEW_TOKENS) + PAGE_SIZE


def admitted_offset(max_new_tokens: int) -> int:
    """What ``_update_prefill_budget`` adds to the offset for a request admitted in the same
    round, beyond its prompt: ``min(max_new_tokens, CLIP)`` and a page (no ratio either)."""
    return min(max(0, max_new_tokens), CLIP_MAX_NEW_TOKENS) + PAGE_SIZE


def steady_kv_per_request(input_tokens: float, output_tokens: float) -> float:
    """KV tokens a running request holds on average over its life: its prompt and, decoding
    at a steady pace, half its output. What the pool must hold per running request so that
    optimistic admission does not keep retracting."""
    return input_tokens + output_tokens / 2
