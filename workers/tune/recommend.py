"""What to change for a given binding constraint, chosen among predicted levers, with reasons."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.tune.flags import apply_changes
from workers.tune.levers import (
    KV_MIN_GAIN,
    LOSSY_MIN_GAIN,
    SEARCH_STEP,
    Option,
    Situation,
    _sized,
    choose,
    kv_options,
    running_cap_options,
)
from workers.tune.memory_model import DoesNotFit, MemoryModel, Prediction
from workers.tune.situation import EngineView, is_speculative, situation
from workers.tune.throughput import CANARY_MIN_GAIN
from workers.tune.verdict import Verdict

# A lever must raise the running cap by this share to be worth a restart.
MIN_CAP_GAIN = 0.1


@dataclass
class Recommendation:
    """Flag changes (None removes a flag), client concurrency and the predicted result."""

    flags: dict[str, Any]
    client_concurrency: int | None
    predicted: Prediction | None
    chosen: str | None
    reasons: list[str] = field(default_factory=list)
    options: list[Option] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ``recommendation`` object of ``diagnose --json``."""
        return {
            "flags": self.flags,
            "client_concurrency": self.client_concurrency,
            "predicted": self.predicted.to_json() if self.predicted else None,
            "chosen": self.chosen,
            "reasons": self.reasons,
            "options": [o.to_json() for o in self.options],
        }


def client_concurrency_for(cap: int, headroom: float) -> int:
    """Requests a client should keep in flight for an engine capped at ``cap``."""
    return math.ceil(cap * headroom) + 1


def _describe(option: Option, sit: Situation) -> str:
    assert option.prediction is not None
    plan = option.prediction.plan
    held = "" if option.kv_running is None else (
        f" (they hold {option.kv_running} requests of {sit.kv_need.describe()})")
    return (
        f"{option.name}: predicted {option.running} running "
        f"({plan.max_mamba_cache_size} slots, R={plan.mamba_ratio}, cap "
        f"{plan.max_running_requests}), {plan.max_total_num_tokens:,} KV tokens{held}, "
        f"~{option.tok_s:,.0f} tok/s (throughput model: {sit.throughput.source})"
    )


def current_running(view: EngineView, sit: Situation) -> int:
    """What the running engine holds of this job: its cap, or fewer where its KV binds."""
    if view.current is None:
        return sit.current_cap
    return min(sit.current_cap, sit.kv_running(view.current))


def _kv_now_reason(view: EngineView, sit: Situation) -> str | None:
    """Said when the running engine's own KV pool holds fewer of this job than its cap."""
    if view.current is None or current_running(view, sit) >= sit.current_cap:
        return None
    kv = view.current.plan.max_total_num_tokens
    return (
        f"now: {sit.current_cap} running allowed but {kv:,} KV tokens hold only "
        f"{sit.kv_running(view.current)} requests of {sit.kv_need.describe()}: KV, not the "
        f"cap, binds this job"
    )


def _kv_binds_reason(model: MemoryModel, chosen: Option, sit: Situation) -> str | None:
    """Said when more slots would fit in memory but their KV pool would hold fewer requests."""
    flags = apply_changes(sit.flags, chosen.changes)
    more = chosen.cap + SEARCH_STEP
    try:
        pred = model.predict(_sized(model, flags, more))
    except DoesNotFit:
        return None
    held = sit.kv_running(pred)
    if pred.cap != more or held >= more:
        return None
    return (
        f"stops at {chosen.cap}: {more} slots would fit, but their "
        f"{pred.plan.max_total_num_tokens:,} KV tokens hold only {held} requests of "
        f"{sit.kv_need.describe()}: KV, not the slots, sets the cap"
    )


def _cause_reason(view: EngineView, verdict: Verdict, cap: int) -> str:
    slots, ratio = view.value("mamba_slots"), view.value("mamba_ratio")
    kv, queued = view.readings.get("kv_usage"), view.readings.get("queued")
    free = view.readings.get("gpu_memory_free_mib")
    memory = f"KV usage {kv:.1%}" if kv is not None else "KV usage unknown"
    if free is not None:
        memory += f", {free / 1024:.1f} GiB free on the GPU"
    if verdict.cause == "mamba_slots":
        return (
            f"{slots} Mamba slots // R={ratio} caps the engine at {cap} running while "
            f"{queued} wait ({memory}): memory is not the limit, the slot count is"
        )
    if verdict.cause == "speculative_default":
        return (
            f"speculative decoding without --max-running-requests resets the cap to 48 ({memory})"
        )
    if verdict.cause == "explicit_flag":
        explicit = view.flags.get("max-running-requests")
        return f"--max-running-requests {explicit} caps the engine at {cap} ({memory})"
    return f"SGLang's KV-based estimate caps the engine at {cap} ({memory})"


def _radix_reason(options: list[Option], chosen: Option, sit: Situation) -> str | None:
    no_radix = next((o for o in options if o.name == "no_radix"), None)
    keep = next((o for o in options if o.name == "more_slots"), None)
    if no_radix is None or keep is None:
        return None
    if chosen.name.startswith("no_radix"):
        share = "unknown" if sit.prefill_share is None else f"{sit.prefill_share:.1%}"
        return (
            f"--disable-radix-cache: R drops to 1 because prompts share "
            f"{sit.cache_hit_rate:.1%} of their tokens, so the radix cache saves little while "
            f"each running request holds extra Mamba slots; {no_radix.cap} running vs "
            f"{keep.cap} keeping it. Cost: those {sit.cache_hit_rate:.1%} of prompt tokens are "
            f"prefilled again (prefill is {share} of the tokens processed), counted as "
            f"{sit.no_radix_cost():.1%} less throughput"
        )
    return f"--disable-radix-cache ({no_radix.cap} running): {no_radix.note or 'not better'}"


def _bf16_reason(options: list[Option], chosen: Option, sit: Situation) -> str | None:
    lossy = [o for o in options if o.lossy and o.prediction is not None and o.eligible]
    best = max(lossy, key=lambda o: o.tok_s, default=None)
    if best is None:
        return None
    if not sit.throughput.shape_measured and not chosen.lossy:
        return (
            f"--mamba-ssm-dtype bfloat16 ({best.name}) would fit {best.cap} running vs "
            f"{chosen.cap}: an accuracy trade-off whose gain is unmeasured (so is throughput "
            f"above {sit.throughput.measured_up_to:g} running), so it is not chosen; try it once "
            f"a canary has measured the curve"
        )
    gain = best.tok_s / chosen.tok_s - 1 if chosen.tok_s else 0.0
    if chosen.lossy:
        return f"{chosen.name} chosen although lossy: +{gain:.0%} over the best lossless lever"
    return (
        f"--mamba-ssm-dtype bfloat16 ({best.name}, {best.cap} running) would add {gain:+.0%} "
        f"tok/s: under the {LOSSY_MIN_GAIN:.0%} bar for an accuracy trade-off (the SSM state "
        f"carries the whole reasoning trace)"
    )


def _cap_reason(view: EngineView, chosen: Option) -> str | None:
    if not is_speculative(view):
        return None
    stranded = view.value("stranded_gib") or 0.0
    return (
        f"--max-running-requests set to {chosen.cap} = slots // R: with speculative decoding "
        f"an unset cap becomes 48 and reserves intermediate state for requests that can never "
        f"run ({stranded:.1f} GiB stranded now)"
    )


def _knee_reason(chosen: Option, sit: Situation) -> str | None:
    tput = sit.throughput
    knee = tput.knee()
    if knee is None:
        seen = (
            f"measured at steady state up to {tput.measured_up_to:g} running, not above"
            if tput.measured_up_to
            else "not measured at steady state"
        )
        return (
            f"throughput curve {seen}, so no knee is claimed: "
            f"{chosen.cap} running is the most memory allows. Check: tune auto relaunches one "
            f"GPU and keeps the profile only if the engine's decode tok/s over a window at its "
            f"cap rises by {CANARY_MIN_GAIN:.0%}, else rolls it back"
        )
    if chosen.cap < knee:
        return None
    return (
        f"stops at {chosen.cap} running: past the throughput knee ({tput.source}) more requests "
        f"barely pay off"
    )


def _supply_reason(view: EngineView, chosen: Option) -> str | None:
    """When the worker cannot hold as many of the job's prompts as the launch would run."""
    held = (view.job or {}).get("worker_prompts_max")
    if not held or held >= chosen.cap:
        return None
    size = int((view.job or {}).get("batch_size") or held)
    batches = max(held // size, 1)
    return (
        f"the worker holds at most {held} prompts of this job ({batches} batches of {size}), fewer "
        f"than the {chosen.cap} this launch runs: the engine will not fill, and a canary's "
        f"window will not be at steady state; cut the job into batches of at least "
        f"{math.ceil(chosen.cap / batches)}"
    )


def _running_cap(
    view: EngineView, verdict: Verdict, headroom: float
) -> tuple[Verdict, Recommendation]:
    sit = situation(view)
    options = running_cap_options(view.model, sit)
    lossless = choose([o for o in options if not o.lossy])
    # A lossy lever must win by a measured margin: on an unmeasured curve it is only named.
    chosen = choose(options) if sit.throughput.shape_measured else lossless
    now = current_running(view, sit)
    if lossless is None or chosen is None or lossless.running < now * (1 + MIN_CAP_GAIN):
        notes = [*verdict.notes, f"first read as {verdict.constraint} ({verdict.cause})"]
        return _gpu_memory(
            view, Verdict("gpu_memory", "no_room_for_more_running", notes), sit, options, headroom
        )
    reasons = [_cause_reason(view, verdict, sit.current_cap), _describe(chosen, sit)]
    for extra in (
        _kv_now_reason(view, sit),
        _kv_binds_reason(view.model, chosen, sit),
        _radix_reason(options, chosen, sit),
        _bf16_reason(options, chosen, sit),
        _cap_reason(view, chosen),
        _knee_reason(chosen, sit),
        _supply_reason(view, chosen),
    ):
        if extra:
            reasons.append(extra)
    rec = Recommendation(
        chosen.changes,
        client_concurrency_for(chosen.cap, headroom),
        chosen.prediction,
        chosen.name,
        reasons,
        options,
    )
    return verdict, rec


def _gpu_memory(
    view: EngineView, verdict: Verdict, sit: Situation, options: list[Option], headroom: float
) -> tuple[Verdict, Recommendation]:
    usable = [o for o in options if o.eligible and o.prediction is not None]
    best = max(usable, key=lambda o: o.tok_s, default=None)
    cap = current_running(view, sit)
    if best is not None and best.running >= cap * (1 + MIN_CAP_GAIN):
        reasons = [
            f"no lossless lever fits more than {cap} running on this GPU",
            _describe(best, sit),
            "lossy: check output quality on a sample before rolling it out",
        ]
        rec = Recommendation(
            best.changes,
            client_concurrency_for(best.running, headroom),
            best.prediction,
            best.name,
            reasons,
            options,
        )
        return verdict, rec
    reasons = [
        f"no lever fits more than {cap} running on this GPU: add GPUs or shorten the context"
    ]
    return verdict, Recommendation(
        {}, client_concurrency_for(cap, headroom), view.current, None, reasons, options
    )


def _client(view: EngineView, verdict: Verdict, headroom: float) -> tuple[Verdict, Recommendation]:
    sit = situation(view)
    cap = sit.current_cap
    target = client_concurrency_for(cap, headroom)
    in_flight = view.readings.get("client_in_flight")
    sent = (
        f"the client keeps {in_flight} in flight"
        if in_flight is not None
        else "the client sends too few"
    )
    reasons = [
        f"the engine runs {view.readings.get('running')} of {cap} with an empty queue; {sent}",
        f"keep {target} in flight (cap x {headroom} + 1) so the queue never runs dry",
    ]
    return verdict, Recommendation({}, target, view.current, "client_concurrency", reasons)


def _compute(view: EngineView, verdict: Verdict, headroom: float) -> tuple[Verdict, Recommendation]:
    sit = situation(view)
    tput = sit.throughput
    reasons = [
        f"throughput is flat in running requests ({tput.source}): more slots would not help",
        "more throughput needs more GPUs (or a cheaper step: speculative settings, shorter "
        "outputs)",
    ]
    return verdict, Recommendation({}, None, view.current, None, reasons)


def _kv_gain(chosen: Option | None, now: int) -> int | None:
    """KV tokens ``chosen`` predicts, if it adds at least KV_MIN_GAIN."""
    if chosen is None or chosen.prediction is None:
        return None
    new = chosen.prediction.plan.max_total_num_tokens
    return new if new >= now * (1 + KV_MIN_GAIN) else None


def _kv(view: EngineView, verdict: Verdict, headroom: float) -> tuple[Verdict, Recommendation]:
    sit = situation(view)
    options = kv_options(view.model, sit, view.readings.get("mamba_usage"))
    chosen = choose(options, key="kv_tokens")
    current = view.current.plan.max_total_num_tokens if view.current else 0
    now = int(view.readings.get("kv_tokens") or current)
    usage = f"KV usage {view.readings.get('kv_usage'):.0%}, {view.readings.get('queued')} queued"
    new = _kv_gain(chosen, now)
    if chosen is None or new is None:
        reasons = [
            f"{usage}: admission waits for KV room",
            f"no lever adds {KV_MIN_GAIN:.0%} more KV tokens: shorten the context or add GPUs",
        ]
        return verdict, Recommendation({}, None, view.current, None, reasons, options)
    lossy = " (lossy)" if chosen.lossy else ""
    reasons = [
        f"{usage}: admission waits for KV room",
        f"{chosen.name}: {now:,} -> {new:,} KV tokens{lossy}",
    ]
    # KV, not the running cap, limits admission here: the client needs no change.
    return verdict, Recommendation(
        chosen.changes, None, chosen.prediction, chosen.name, reasons, options
    )


_BY_CONSTRAINT: dict[
    str, Callable[[EngineView, Verdict, float], tuple[Verdict, Recommendation]]
] = {
    "running_cap": _running_cap,
    "client_concurrency": _client,
    "compute": _compute,
    "kv_capacity": _kv,
}


def recommend(
    view: EngineView, verdict: Verdict, headroom: float
) -> tuple[Verdict, Recommendation]:
    """The recommendation for ``verdict`` (a running cap with no room becomes ``gpu_memory``).

    Every lever but the client's is a relaunch, predicted from the model's config.json: where
    that cannot be read, the recommendation says so (and where it looked) instead of a claim
    about what fits that nothing checked."""
    cannot = view.model.cannot_plan
    if cannot is not None and verdict.constraint != "client_concurrency":
        reason = f"cannot plan a relaunch without the model's config.json ({cannot})"
        return verdict, Recommendation({}, None, view.current, None, [reason], [])
    return _BY_CONSTRAINT[verdict.constraint](view, verdict, headroom)
