"""Everything diagnose and its recommendation need about one engine, built from a snapshot.

Brings together the readings, the launch flags, the memory model calibrated from the engine's
own startup arithmetic, its prediction for the current flags (which must reproduce what the
engine reports), and the throughput curve from the engine at steady state (at its cap with a
queue: ``workers.tune.throughput``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workers.engine import capacity
from workers.engine.log import parse_log
from workers.tune import kv_floor, throughput
from workers.tune.flags import FlagMap, snapshot_flags
from workers.tune.levers import Situation
from workers.tune.memory_model import DoesNotFit, MemoryModel, Prediction, calibrate
from workers.tune.readings import Reading, Readings, read_snapshot
from workers.tune.throughput import ThroughputModel

# Memory NVML must keep free after a mem-fraction-static raise: activations grow with the
# batch, so leave the larger of 2 GiB and 3 % of the GPU.
FREE_MARGIN_GIB = 2.0
FREE_MARGIN_SHARE = 0.03


class InsufficientEvidence(ValueError):
    """The snapshot lacks the readings needed to name a binding constraint."""


class MemoryUnknown(InsufficientEvidence):
    """The GPU's memory is unknown: the constraint can be named, no memory arithmetic done."""


@dataclass
class EngineView:
    """One engine as the tuner understands it."""

    readings: Readings
    flags: FlagMap
    model: MemoryModel
    current: Prediction | None
    throughput: ThroughputModel
    throughput_points: list[tuple[float, float]]
    derived: dict[str, Reading]
    # The snapshot's ``job`` section: the running job's lengths (workers/tune/job_lengths.py).
    job: Mapping[str, Any] | None = None

    def value(self, name: str) -> Any:
        """A reading's or derived value's value, or None."""
        if name in self.derived:
            return self.derived[name].value
        return self.readings.get(name)

    def evidence(self, *names: str) -> list[dict[str, Any]]:
        """Evidence entries for readings and derived values, in the order named."""
        out = []
        for name in names:
            if name in self.derived:
                out.append(self.derived[name].as_evidence())
            else:
                out.extend(self.readings.evidence(name))
        return out


def _gpu_memory_mib(readings: Readings, override: int | None) -> int:
    """GPU memory for the model: the override (a simulated GPU), else NVML, else the log."""
    if override:
        return override
    total = readings.get("gpu_memory_total_mib")
    if total:
        return int(total)
    before = readings.log.weights_begin_avail_gib
    if before:
        return math.ceil(before * 1024)
    raise MemoryUnknown("GPU memory unknown (no NVML section): pass --gpu-memory-mib")


def log_starts(text: str) -> list[str]:
    """The log split into engine starts, oldest first (``parse_log``'s rule for a restart)."""
    starts: list[list[str]] = [[]]
    scheduled = False
    for line in text.splitlines(keepends=True):
        if "Load weight begin" in line and scheduled:
            starts.append([])
            scheduled = False
        starts[-1].append(line)
        scheduled = scheduled or "max_total_num_tokens=" in line
    return ["".join(s) for s in starts if s]


def _earlier_starts(text: str) -> list[tuple[float, float]]:
    """Steady-state points of the earlier starts in the log (each under its own cap)."""
    points = []
    for chunk in log_starts(text)[:-1]:
        facts = parse_log(chunk)
        if facts.scheduler is not None:
            cap = facts.scheduler.max_running_requests
            points.extend(throughput.steady_decode_points(facts.decode_lines(), cap))
    return points


def steady_points(snapshot: Mapping[str, Any], readings: Readings) -> list[tuple[float, float]]:
    """(running, tok/s) at steady state: this start's decode lines, else its sampled gauges,
    else the current /metrics gauges; plus the earlier starts' decode lines."""
    cap = readings.get("effective_cap") or 0
    points = throughput.steady_decode_points(readings.log.decode_lines(), cap)
    if not points:
        samples = snapshot.get("samples")
        if isinstance(samples, list):
            points = throughput.steady_sample_points(s for s in samples if isinstance(s, Mapping))
    running, queued = readings.get("running"), readings.get("queued")
    tok_s = readings.metrics.total("gen_throughput")
    if not points and tok_s and throughput.steady(running, queued, cap):
        points = [(float(running), float(tok_s))]
    return _earlier_starts(snapshot.get("log") or "") + points


def _predict_current(model: MemoryModel, flags: FlagMap) -> Prediction | None:
    try:
        return model.predict(flags)
    except DoesNotFit:
        return None


def _derive(view: EngineView, gpu_mib: int) -> None:
    d = view.derived
    d["gpu_memory_mib"] = Reading("gpu_memory_mib", gpu_mib, "nvml, --gpu-memory-mib or log")
    if view.current is not None:
        plan = view.current.plan
        strategy = view.flags.get("mamba-scheduler-strategy", "auto")
        d["mamba_ratio"] = Reading(
            "mamba_ratio",
            plan.mamba_ratio,
            f"memory model (_calculate_mamba_ratio): strategy={strategy}, "
            f"radix={'off' if view.flags.get('disable-radix-cache') else 'on'}, "
            f"overlap={'on' if plan.overlap_schedule else 'off'}",
        )
        d["stranded_gib"] = Reading(
            "stranded_gib",
            round(plan.memory_gib["free"], 2),
            "memory model: pool reserved for speculative states of requests that cannot run",
        )
        d["predicted_cap"] = Reading("predicted_cap", plan.max_running_requests, "memory model")
    if view.readings.get("running") and view.value("kv_used_tokens") is not None:
        per = view.value("kv_used_tokens") / view.readings.get("running")
        d["kv_tokens_per_running"] = Reading(
            "kv_tokens_per_running", round(per), "kv_used_tokens / running"
        )
    tput = view.throughput
    if tput.shape_measured:
        d["throughput_fit"] = Reading("throughput_half_n", round(tput.half_n, 1), tput.source)
    elif view.throughput_points:
        d["throughput_fit"] = Reading("throughput_measured_up_to", tput.measured_up_to, tput.source)
    else:
        d["throughput_fit"] = Reading(
            "throughput_measured_up_to", 0,
            f"no steady state (never at the cap with a queue): {tput.source} assumed",
        )


def view_from_snapshot(
    snapshot: Mapping[str, Any], gpu_memory_mib: int | None = None
) -> EngineView:
    """Build the engine view; raises InsufficientEvidence without running/queue readings."""
    readings = read_snapshot(snapshot)
    missing = [n for n in ("running", "queued") if n not in readings]
    if missing:
        raise InsufficientEvidence(f"no reading for {', '.join(missing)} in the snapshot")
    flags = snapshot_flags(snapshot)
    gpu_mib = _gpu_memory_mib(readings, gpu_memory_mib or snapshot.get("gpu_memory_mib"))
    env = (snapshot.get("profile") or {}).get("env") or {}
    model = calibrate(flags, gpu_mib, readings.log, snapshot.get("server_info"), env,
                      snapshot.get("model_config"))
    points = steady_points(snapshot, readings)
    view = EngineView(
        readings, flags, model, _predict_current(model, flags), throughput.fit(points), points, {},
        snapshot.get("job") if isinstance(snapshot.get("job"), Mapping) else None,
    )
    _derive(view, gpu_mib)
    return view


def effective_cap(view: EngineView) -> int:
    """The engine's effective running cap: reported, else predicted."""
    cap = view.readings.get("effective_cap") or view.value("predicted_cap")
    if not cap:
        raise InsufficientEvidence("no effective running cap reported or predicted")
    return int(cap)


def extra_fraction(view: EngineView) -> float:
    """mem-fraction-static that NVML's free memory allows adding (0 when unknown)."""
    free_mib = view.readings.get("gpu_memory_free_mib")
    total_mib = view.readings.get("gpu_memory_total_mib")
    if free_mib is None or not total_mib:
        return 0.0
    total_gib = total_mib / 1024
    stranded = view.value("stranded_gib") or 0.0
    margin = max(FREE_MARGIN_GIB, FREE_MARGIN_SHARE * total_gib)
    room = free_mib / 1024 - stranded - margin
    # Never past the whole GPU less the margin, whatever NVML's free figure says.
    fraction = view.current.plan.mem_fraction_static if view.current else 0.0
    room = min(room, total_gib * (1 - fraction) - margin)
    return max(0.0, math.floor(room / total_gib * 100) / 100)


def _prompt_mean(view: EngineView) -> float | None:
    """Mean prompt tokens of the requests this engine finished (its own counters)."""
    metrics = view.readings.metrics
    done, prompt = metrics.total("num_requests_total"), metrics.total("prompt_tokens_total")
    return prompt / done if done and prompt is not None else None


def kv_need_per_request(view: EngineView, context_len: int | None) -> kv_floor.KvNeed:
    """What one running request of the job asks of the KV pool (:mod:`workers.tune.kv_floor`).

    From the running job's own lengths when the snapshot carries them (its max_new_tokens and
    completed rows), else every request to the engine's ``--context-length`` (the
    conservative bound). What requests held when the snapshot was taken (KV used / running)
    is only a floor under either: a snapshot of young requests, or of a lighter load than the
    job's, under-states what a request holds over its life.
    """
    prompt = _prompt_mean(view)
    need = kv_floor.need_from_job(view.job, context_len or 8192, prompt) if view.job else None
    if need is None and context_len:
        need = kv_floor.need_from_context(context_len, prompt or 0.0)
    held = view.derived.get("kv_tokens_per_running")
    if need is None:
        now = float(held.value) if held is not None and held.value else 4096.0
        return kv_floor.KvNeed(prompt or 0.0, now, 8192, kv_floor.BASIS_HELD,
                               f"{held.source if held else 'nothing read'}: held when the "
                               f"snapshot was taken, a lower bound (no job lengths, no context)")
    if held is not None and held.value and float(held.value) > need.held:
        need = kv_floor.KvNeed(need.prompt, float(held.value), need.max_new, need.basis,
                               f"{held.source} (held now, above {need.describe()}: "
                               f"{need.source})")
    return need


def situation(view: EngineView) -> Situation:
    """The option search's inputs for this engine."""
    plan = view.current.plan if view.current else None
    known = view.readings.get("context_len") or (plan.context_len if plan else None)
    context_len = int(known or 8192)
    need = kv_need_per_request(view, int(known) if known else None)
    view.derived["kv_need_per_request"] = Reading(
        "kv_need_per_request", round(need.held), f"{need.basis}: {need.source}")
    fraction = plan.mem_fraction_static if plan else 0.0
    return Situation(
        flags=view.flags,
        current_cap=effective_cap(view),
        context_len=context_len,
        kv_need=need,
        cache_hit_rate=view.readings.get("cache_hit_rate"),
        prefill_share=view.readings.get("prefill_share"),
        fraction=fraction,
        extra_fraction=extra_fraction(view),
        throughput=view.throughput,
        samples_per_prompt=float((view.job or {}).get("samples_per_prompt") or 1.0),
    )


def is_speculative(view: EngineView) -> bool:
    """Whether the engine runs speculative decoding."""
    return capacity.speculative(view.model.engine_flags(view.flags))
