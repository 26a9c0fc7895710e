"""Retry policy as data plus one pure backoff function."""

from __future__ import annotations

import random
from dataclasses import dataclass

from workers.errors import InputError, PromptRejected

# Errors that no retry can fix: the row is quarantined instead.
NON_RETRYABLE: tuple[type[Exception], ...] = (InputError, PromptRejected)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a transient failure is retried."""

    max_attempts: int = 5
    base_s: float = 1.0
    max_s: float = 30.0
    jitter: float = 0.25


def backoff_s(attempt: int, policy: RetryPolicy, rng: random.Random | None = None) -> float:
    """Delay before retry number ``attempt`` (1-based): exponential, capped, with jitter."""
    delay = min(policy.max_s, policy.base_s * (2 ** max(0, attempt - 1)))
    spread = delay * policy.jitter
    return max(0.0, delay + (rng or random).uniform(-spread, spread))
