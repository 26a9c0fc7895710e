"""Name the constraint that binds one engine's throughput, from the evidence in a snapshot.

The constraints (issue 5): ``client_concurrency`` (the engine's queue is empty and it runs
below its cap), ``running_cap`` (running at the effective cap with requests queued while KV
and memory are not short; the cause is the Mamba slots / R, the speculative default of 48 or
an explicit flag), ``kv_capacity`` (KV usage high with requests queued), ``gpu_memory`` (at the
cap and no lossless lever makes room for more), ``compute`` (more running requests no longer
raise throughput, shown by the engine at steady state over a wide enough range of running
counts: ``ThroughputModel.saturated_at``; warm-up lines never show it). GPU utilisation is
reported but never used: an engine starved by a scheduler cap reads 83-99 % busy (the observed
run).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workers.engine.capacity import SPECULATIVE_DEFAULT_MAX_RUNNING
from workers.tune import throughput
from workers.tune.partial import PartialDiagnosis, diagnose_partial
from workers.tune.recommend import Recommendation, recommend
from workers.tune.situation import (
    EngineView,
    MemoryUnknown,
    effective_cap,
    is_speculative,
    view_from_snapshot,
)
from workers.tune.verdict import Verdict

CONSTRAINTS = ("client_concurrency", "running_cap", "kv_capacity", "gpu_memory", "compute")
# KV usage at which admission stalls: SGLang reserves room for future output tokens.
KV_HIGH = 0.9
# Mamba usage at which slots, not the cap, hold admission back.
MAMBA_HIGH = 0.9

BASE_EVIDENCE = (
    "running",
    "queued",
    "effective_cap",
    "cli_max_running_requests",
    "kv_usage",
    "kv_used_tokens",
    "kv_tokens",
    "kv_need_per_request",
    "mamba_usage",
    "mamba_slots",
    "mamba_ratio",
    "gen_throughput",
    "accept_length",
    "cache_hit_rate",
    "gpu_memory_free_mib",
    "gpu_memory_total_mib",
    "stranded_gib",
    "client_in_flight",
    "client_queued_batches",
    "gpu_utilization_gpu_pct",
)


@dataclass
class Diagnosis:
    """The binding constraint, its evidence and what to do about it."""

    verdict: Verdict
    evidence: list[dict[str, Any]]
    recommendation: Recommendation
    view: EngineView

    def to_json(self) -> dict[str, Any]:
        """The ``diagnose --json`` object."""
        current = self.view.current
        return {
            "binding_constraint": self.verdict.constraint,
            "cause": self.verdict.cause,
            "notes": self.verdict.notes,
            "evidence": self.evidence,
            "unread_evidence": self.view.model.unread,
            "recommendation": self.recommendation.to_json(),
            "memory_model": {
                "measured": [m.as_evidence() for m in self.view.model.measured],
                "current": current.to_json() if current else None,
            },
        }


def _cap_cause(view: EngineView, cap: int) -> str:
    slots, ratio = view.value("mamba_slots"), view.value("mamba_ratio")
    explicit = view.flags.get("max-running-requests")
    if slots and ratio and cap == slots // ratio:
        if explicit is None or slots // ratio <= int(explicit):
            return "mamba_slots"
    if explicit is None and is_speculative(view) and cap == SPECULATIVE_DEFAULT_MAX_RUNNING:
        return "speculative_default"
    if explicit is not None and cap == int(explicit):
        return "explicit_flag"
    return "kv_estimate"


def _utilisation_note(view: EngineView) -> list[str]:
    util = view.readings.get("gpu_utilization_gpu_pct")
    if util is None:
        return []
    return [f"GPU utilisation {util}% is not used as evidence: a capped engine also reads busy"]


def classify(view: EngineView, cap: int) -> Verdict:
    """The binding constraint for an engine with effective cap ``cap``."""
    running, queued = view.readings.get("running"), view.readings.get("queued")
    kv = view.readings.get("kv_usage")
    at_cap = throughput.at_cap(running, cap)
    notes = _utilisation_note(view)
    if queued > 0 and kv is not None and kv >= KV_HIGH:
        return Verdict("kv_capacity", "kv_pool_full", notes)
    if not at_cap and queued == 0:
        return Verdict("client_concurrency", "engine_queue_empty", notes)
    if view.throughput.saturated_at(running):
        return Verdict("compute", "throughput_flat_in_running", notes)
    if at_cap:
        if queued == 0:
            notes.append("the client sends just enough to fill the cap: raise both together")
        return Verdict("running_cap", _cap_cause(view, cap), notes)
    if (view.readings.get("mamba_usage") or 0) >= MAMBA_HIGH:
        return Verdict("running_cap", "mamba_slots", notes)
    return Verdict("compute", "prefill_admission", notes)


def diagnose(
    snapshot: Mapping[str, Any], gpu_memory_mib: int | None = None, headroom: float = 1.25
) -> Diagnosis | PartialDiagnosis:
    """Diagnose one engine from its snapshot; raises InsufficientEvidence when it cannot.

    Without the GPU's memory (a pasted /metrics, say), the constraint the figures show is still
    named, with no flag change and a list of the evidence that would allow one.
    """
    try:
        view = view_from_snapshot(snapshot, gpu_memory_mib)
    except MemoryUnknown as exc:
        return diagnose_partial(snapshot, str(exc))
    cap = effective_cap(view)
    verdict = classify(view, cap)
    verdict, rec = recommend(view, verdict, headroom)
    evidence = view.evidence(*BASE_EVIDENCE, "predicted_cap", "throughput_fit")
    return Diagnosis(verdict, evidence, rec, view)
