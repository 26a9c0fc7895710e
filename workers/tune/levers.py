"""The levers the tuner can pull, each predicted with the memory model, and the choice among them.

For a running cap (the levers of ``model_runner_kv_cache_mixin.py``'s arithmetic):

- more Mamba slots with the current cache mode, and ``--max-running-requests = slots // R``
  set explicitly (mandatory with speculative decoding: otherwise 48, and the speculative
  intermediate states are reserved for requests that can never run);
- ``--disable-radix-cache`` (R = 1 instead of 5 under ``extra_buffer`` + overlap): only
  when the prompts share almost no prefix, which the cache hit rate shows;
- ``--mamba-ssm-dtype bfloat16`` (half the SSM state per slot): an accuracy trade-off, so
  only when it beats the best lossless option by a clear margin;
- a higher ``--mem-fraction-static`` where NVML shows memory that is really free.

Every option is the relaunch arithmetic's prediction for its flags, so what SGLang refuses by
rule (``launch_refusals.known_refusals``: e.g. ``extra_buffer`` on the Mamba-2 hybrids Falcon-H1,
Nemotron-H and Granite-4.0-H through 0.5.13) is never proposed; for those the scheduler strategy
stays ``no_buffer`` (R = 3), and the levers are more slots, no radix cache (R = 1, overlap back
on) and the bf16 SSM state (Granite's config dtype is not read, only the flag).

For KV capacity: the free memory, fewer Mamba slots where they sit idle, and FP8 KV (lossy).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from workers.engine import capacity
from workers.tune.flags import FlagMap, apply_changes, flag_changes
from workers.tune.kv_floor import KvNeed, kv_held_requests
from workers.tune.memory_model import DoesNotFit, MemoryModel, Prediction
from workers.tune.throughput import ThroughputModel

# Prompts sharing less than this share of their tokens gain nothing from the radix cache.
NO_RADIX_MAX_HIT_RATE = 0.1
# A lossy lever (bf16 SSM state, FP8 KV) must beat the best lossless one by this much.
LOSSY_MIN_GAIN = 0.2
# KV-capacity levers must add at least this share of KV tokens to be worth a restart.
KV_MIN_GAIN = 0.1
# A mem-fraction-static raise smaller than this share of the GPU is not worth its risk.
MIN_FRACTION_STEP = 0.02
# Upper end of the running-count search when no measured knee bounds it, and its stride.
MAX_RUNNING_SEARCH = 1024
SEARCH_STEP = 8

NO_RADIX = {"disable-radix-cache": True, "mamba-scheduler-strategy": None}
BF16_SSM = {"mamba-ssm-dtype": "bfloat16"}
FP8_KV = {"kv-cache-dtype": "fp8_e4m3"}


@dataclass(frozen=True)
class Situation:
    """What the option search needs to know about the running engine."""

    flags: FlagMap
    current_cap: int
    context_len: int
    # What one running request of the job asks of the KV pool (workers/tune/kv_floor.py).
    kv_need: KvNeed
    cache_hit_rate: float | None
    prefill_share: float | None  # prefill's share of the tokens processed (None: unknown)
    fraction: float  # resolved mem_fraction_static of the running engine
    extra_fraction: float  # what NVML says could be added to it
    throughput: ThroughputModel
    # Samples per prompt of the running job (enqueue --samples): each is a running request,
    # and without the radix cache each prefills its prompt again.
    samples_per_prompt: float = 1.0

    def kv_running(self, prediction: Prediction) -> int:
        """Running requests of this job the prediction's KV pool admits and holds."""
        return kv_held_requests(prediction.plan.max_total_num_tokens, self.kv_need)

    def no_radix_cost(self) -> float:
        """Share of throughput lost by recomputing the prompt tokens the radix cache serves.

        Prefill's share of the processed tokens times the hit rate: per token prefill is cheaper
        than decode, so this overstates the cost (it never makes the lever look better). With N
        samples per prompt the prompt is prefilled once and served from the cache N times
        (workers/batch/runner.py); without the cache it is prefilled N times, so the prefill
        already counted is repeated N - 1 times more, whatever hit rate was measured.
        """
        share = 1.0 if self.prefill_share is None else self.prefill_share
        repeated = share * max(self.samples_per_prompt - 1.0, 0.0)
        if not self.cache_hit_rate:
            return min(1.0, repeated)
        return min(1.0, max(self.cache_hit_rate * share, repeated))

    def raised_fraction(self) -> dict[str, Any]:
        """The mem-fraction-static change using the free memory, or {} if there is none."""
        if self.extra_fraction < MIN_FRACTION_STEP:
            return {}
        return {"mem-fraction-static": round(self.fraction + self.extra_fraction, 2)}

    def lower_fractions(self) -> Iterator[dict[str, Any]]:
        """Smaller raises, one hundredth at a time, down to MIN_FRACTION_STEP: NVML's free
        memory is an upper bound (the speculative draft's pool, sized from the target's
        tokens, comes out of what the fraction leaves)."""
        top = round(self.fraction + self.extra_fraction, 2)
        for k in range(1, round(self.extra_fraction * 100) + 1):
            lower = round(top - k / 100, 2)
            if lower < self.fraction + MIN_FRACTION_STEP:
                return
            yield {"mem-fraction-static": lower}


@dataclass(frozen=True)
class Option:
    """One candidate flag change and what the memory and throughput models predict for it."""

    name: str
    changes: dict[str, Any]
    prediction: Prediction | None
    tok_s: float
    lossy: bool
    eligible: bool
    note: str
    # Running requests of the job its KV pool holds (None: not computed).
    kv_running: int | None = None

    @property
    def cap(self) -> int:
        """Predicted effective running cap (0 if it does not fit)."""
        return self.prediction.cap if self.prediction else 0

    @property
    def running(self) -> int:
        """What the engine would run of this job: the cap, or fewer where KV binds."""
        return self.cap if self.kv_running is None else min(self.cap, self.kv_running)

    def to_json(self) -> dict[str, Any]:
        """The option as reported under ``recommendation.options``."""
        return {
            "name": self.name,
            "flags": self.changes,
            "predicted": self.prediction.to_json() if self.prediction else None,
            "predicted_tok_s": round(self.tok_s),
            "kv_holds_requests": self.kv_running,
            "effective_running": self.running,
            "lossy": self.lossy,
            "eligible": self.eligible,
            "note": self.note,
        }


def _ratio(model: MemoryModel, flags: FlagMap) -> int:
    return capacity.mamba_ratio(model.engine_flags(flags))


def _sized(model: MemoryModel, flags: FlagMap, running: int) -> FlagMap:
    """``flags`` with slots and cap sized for ``running`` requests."""
    sized = dict(flags, **{"max-running-requests": running})
    if model.shape.hybrid:
        sized["max-mamba-cache-size"] = running * _ratio(model, flags)
    return sized


def _fits(model: MemoryModel, flags: FlagMap, running: int, sit: Situation) -> Prediction | None:
    try:
        pred = model.predict(_sized(model, flags, running))
    except DoesNotFit:
        return None
    return pred if pred.cap == running and sit.kv_running(pred) >= running else None


def largest_fit(model: MemoryModel, flags: FlagMap, sit: Situation) -> Prediction | None:
    """The prediction for the most running requests that fit in memory.

    Up to the throughput knee where steady state measured one; otherwise memory alone sets it
    (an unmeasured curve is no reason to stop short: the canary measures the result). What
    fits is a band, not everything below a limit: with speculative decoding the draft's KV
    pool is as many tokens as the target's, so few running requests (a large KV pool) can
    leave the draft no room where more (a smaller pool) fit. The search steps down from the
    top in SEARCH_STEP strides to the first count that fits, then up to the band's edge.
    """
    top = sit.throughput.knee() or MAX_RUNNING_SEARCH
    for n in range(top, 0, -SEARCH_STEP):
        best = _fits(model, flags, n, sit)
        if best is None:
            continue
        for up in range(n + 1, min(top, n + SEARCH_STEP - 1) + 1):
            pred = _fits(model, flags, up, sit)
            if pred is None:
                break
            best = pred
        return best
    return None


def _variants(sit: Situation, hybrid: bool) -> Iterator[tuple[str, dict[str, Any], bool, str]]:
    """(name, changes, lossy, eligibility note) for every running-cap variant."""
    fractions: list[dict[str, Any]] = [{}]
    if sit.raised_fraction():
        fractions.append(sit.raised_fraction())
    modes: list[tuple[str, dict[str, Any]]] = [("more_slots", {})]
    dtypes: list[tuple[str, dict[str, Any]]] = [("", {})]
    if hybrid:
        modes.append(("no_radix", NO_RADIX))
        dtypes.append(("+bf16_ssm", BF16_SSM))
    for mode, mode_changes in modes:
        for suffix, dtype_changes in dtypes:
            for fraction in fractions:
                name = mode + suffix + ("+mem_fraction" if fraction else "")
                changes = {**mode_changes, **dtype_changes, **fraction}
                yield name, changes, bool(dtype_changes), _eligibility(mode, sit)


def _eligibility(mode: str, sit: Situation) -> str:
    if mode != "no_radix":
        return ""
    if sit.samples_per_prompt > 1.0:
        return (f"not chosen: the job samples each prompt {sit.samples_per_prompt:g} times, "
                "and without the radix cache every sample prefills its prompt again")
    if sit.cache_hit_rate is None:
        return "not chosen: the prefix-cache hit rate is unknown"
    if sit.cache_hit_rate >= NO_RADIX_MAX_HIT_RATE:
        return f"not chosen: prompts share prefixes (cache hit rate {sit.cache_hit_rate:.1%})"
    return ""


def running_cap_options(model: MemoryModel, sit: Situation) -> list[Option]:
    """Every running-cap lever, sized to the largest running count that fits."""
    options = []
    for name, changes, lossy, blocked in _variants(sit, model.shape.hybrid):
        flags = apply_changes(sit.flags, changes)
        pred = largest_fit(model, flags, sit)
        lower = sit.lower_fractions() if "mem-fraction-static" in changes else iter(())
        while pred is None and (fraction := next(lower, None)) is not None:
            changes = {**changes, **fraction}
            flags = apply_changes(sit.flags, changes)
            pred = largest_fit(model, flags, sit)
        if pred is not None:
            changes = flag_changes(sit.flags, _sized(model, flags, pred.cap))
        kv_running = sit.kv_running(pred) if pred else None
        running = min(pred.cap, kv_running or 0) if pred else 0
        tok_s = sit.throughput.tok_s(running) if running else 0.0
        if name.startswith("no_radix"):
            tok_s *= 1.0 - sit.no_radix_cost()
        note = blocked or ("" if pred is not None else _why_not(model, flags))
        options.append(Option(name, changes, pred, tok_s, lossy, not blocked, note, kv_running))
    return options


def _why_not(model: MemoryModel, flags: FlagMap) -> str:
    """``does not fit``, or SGLang's rule when it would refuse the flags outright (a Mamba-2
    hybrid under ``extra_buffer`` on 0.5.10-0.5.13, launch_refusals.known_refusals)."""
    try:
        model.predict(flags)
    except DoesNotFit as exc:
        if str(exc).startswith("SGLang refuses"):
            return f"not possible: {exc}"
    return "does not fit"


def _kv_variants(
    model: MemoryModel, sit: Situation, mamba_usage: float | None
) -> list[tuple[str, dict[str, Any], bool]]:
    out: list[tuple[str, dict[str, Any], bool]] = []
    if sit.raised_fraction():
        out.append(("mem_fraction", sit.raised_fraction(), False))
    if model.shape.hybrid and mamba_usage is not None and mamba_usage < 0.5:
        ratio = _ratio(model, sit.flags)
        out.append(("fewer_slots", {"max-mamba-cache-size": sit.current_cap * ratio}, False))
    out.append(("fp8_kv", FP8_KV, True))
    return out


def kv_options(model: MemoryModel, sit: Situation, mamba_usage: float | None) -> list[Option]:
    """Levers that add KV tokens, each predicted."""
    options = []
    for name, changes, lossy in _kv_variants(model, sit, mamba_usage):
        try:
            pred: Prediction | None = model.predict(apply_changes(sit.flags, changes))
        except DoesNotFit:
            pred = None
        kv_running = sit.kv_running(pred) if pred else None
        running = min(pred.cap, kv_running or 0) if pred else 0
        tok_s = sit.throughput.tok_s(running) if running else 0.0
        note = "" if pred else "does not fit"
        options.append(Option(name, changes, pred, tok_s, lossy, True, note, kv_running))
    return options


def choose(options: list[Option], key: str = "tok_s") -> Option | None:
    """Best eligible option: lossless first; lossy only if it wins by LOSSY_MIN_GAIN."""

    def score(o: Option) -> float:
        """What ``key`` ranks options by."""
        if key == "kv_tokens":
            return float(o.prediction.plan.max_total_num_tokens) if o.prediction else 0.0
        return o.tok_s

    usable = [o for o in options if o.eligible and o.prediction is not None]
    lossless = [o for o in usable if not o.lossy]
    lossy = [o for o in usable if o.lossy]
    best = max(lossless, key=score, default=None)
    best_lossy = max(lossy, key=score, default=None)
    if best_lossy is not None and (
        best is None or score(best_lossy) > score(best) * (1 + LOSSY_MIN_GAIN)
    ):
        return best_lossy
    return best
