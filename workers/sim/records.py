"""The records the simulated scheduler works with: a request, its configuration, the usage it
reports (a snapshot and a decode interval) and the observer that turns them into SGLang's
log lines and metrics (:mod:`workers.sim.report`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.sim.calibration import B200_WORKLOAD, Calibration
from workers.sim.radix import CacheMode


@dataclass(eq=False)
class SimRequest:
    """One request inside the simulated scheduler."""

    rid: str
    input_len: int
    max_new_tokens: int  # after Scheduler.init_req_max_new_tokens' clamp
    drawn_len: int  # where the "model" emits EOS
    prefix: tuple[int, ...] = ()  # radix-cache keys of the prompt (workers.sim.radix)
    cached_tokens: int = 0  # prompt tokens found in the radix cache at admission
    internal: bool = False  # health probes: no metrics, no fault markers
    crash: bool = False
    hang: bool = False
    arrival: float = field(default_factory=time.monotonic)
    future: asyncio.Future[SimRequest] | None = None
    stop_at: int = 0
    progress: float = 0.0
    generated: int = 0
    verify_ct: int = 0
    finish_reason: dict[str, Any] | None = None
    finished_at: float = 0.0
    admitted: bool = False
    admitted_at: float = 0.0  # first admission (monotonic), for meta_info's queue_time
    retractions: int = 0
    prompt_ids: list[int] | None = None  # the prompt's token ids when it came as input_ids
    # The answer under a json_schema grammar: a JSON document valid for it
    # (workers/sim/structured.py).
    json_text: str | None = None

    def __post_init__(self) -> None:
        self.stop_at = min(self.drawn_len, self.max_new_tokens)

    @property
    def held(self) -> int:
        """KV tokens held while running: the prompt and the tokens generated so far."""
        return self.input_len + self.generated

    @property
    def remaining(self) -> int:
        """Output tokens left in the request's budget."""
        return max(0, self.max_new_tokens - self.generated)

    @property
    def queue_s(self) -> float:
        """Seconds from arrival to the first admission (0 if never admitted)."""
        return max(0.0, self.admitted_at - self.arrival) if self.admitted_at else 0.0

    @property
    def latency(self) -> float:
        """Seconds from arrival to finish."""
        return self.finished_at - self.arrival


@dataclass(frozen=True)
class EngineConfig:
    """The numbers the scheduler runs under (from the CapacityPlan and the flags)."""

    max_running_requests: int
    max_total_num_tokens: int
    max_prefill_tokens: int
    max_mamba_cache_size: int
    mamba_ratio: int  # 0 for non-hybrid models
    draft_tokens: int  # 0 without speculative decoding
    speed: float
    decode_log_interval: int
    eos_token_id: int
    cache_mode: CacheMode = CacheMode(enabled=False)
    schedule_conservativeness: float = 1.0
    calibration: Calibration = B200_WORKLOAD  # step and prefill times (FLEET_SIM_CALIBRATION)
    mamba_cache_chunk: int = 64  # ServerArgs.mamba_cache_chunk_size: max(FLA chunk 64, page)
    overlap_schedule: bool = False  # Scheduler.event_loop_overlap (else event_loop_normal)


@dataclass(frozen=True)
class Snapshot:
    """Scheduler state as SGLang's logs and gauges report it."""

    running: int
    queued: int
    used_tokens: int
    full_usage: float
    mamba_num: int
    mamba_usage: float
    pending_tokens: int = 0  # prompt tokens waiting (Scheduler._get_num_pending_tokens)
    total_tokens: int = 0  # the KV pool (max_total_num_tokens)
    new_token_ratio: float = 0.0


@dataclass(frozen=True)
class Interval:
    """Decode statistics over the last ``decode_log_interval`` steps."""

    gen_throughput: float
    accept_length: float
    accept_rate: float


class Observer(Protocol):
    """Receives the scheduler's events (logs and metrics)."""

    def on_step(self, decode_tokens: int, prefill_tokens: int, cached_tokens: int = 0) -> None:
        """Called after every step with the tokens it computed (and prefill took from cache)."""

    def on_prefill(
        self, new_reqs: int, new_tokens: int, cached: int, running_before: int, snap: Snapshot
    ) -> None:
        """Called after each admission round that admitted requests."""

    def on_decode_interval(self, snap: Snapshot, interval: Interval) -> None:
        """Called every ``decode_log_interval`` decode steps."""

    def on_finish(self, req: SimRequest) -> None:
        """Called when a request finishes (not for internal ones)."""

    def on_idle(self, snap: Snapshot) -> None:
        """Called when the scheduler runs out of work."""

    def on_crash(self, req: SimRequest) -> None:
        """Called right before a ``__SIM_CRASH__`` request kills the process."""

    def on_retract(self, count: int, old_ratio: float, new_ratio: float) -> None:
        """Called when a decode step retracted ``count`` requests."""
