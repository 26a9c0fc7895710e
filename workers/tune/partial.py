"""Diagnose from whatever a snapshot holds: the binding constraint that /metrics alone shows.

A user pasting an engine's ``/metrics`` (no NVML, no log, no ``/server_info``) still has the
figures that name the constraint: requests waiting while the running count stays below what the
KV pool could hold is a running cap, whatever the memory; a full KV pool with a queue is KV
capacity; an empty queue is the client. What needs the missing pieces is only the memory
arithmetic: which flags would lift the cap, and what they would cost. Those are refused here,
and the evidence that would allow them is listed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.tune.readings import Readings, read_snapshot

# The same thresholds as the full diagnosis (workers.tune.diagnose).
KV_HIGH = 0.9
MAMBA_HIGH = 0.9
EVIDENCE = ("running", "queued", "effective_cap", "kv_usage", "kv_used_tokens", "kv_tokens",
            "mamba_usage", "gen_throughput", "accept_length", "cache_hit_rate")


@dataclass
class PartialDiagnosis:
    """The binding constraint from the readings alone, and what further evidence would add."""

    constraint: str
    cause: str
    readings: Readings
    missing: list[str]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ``diagnose --json`` object (same keys as a full diagnosis, plus
        ``missing_evidence``)."""
        reasons = [
            "no flag change: a memory-fitting recommendation needs the GPU's memory and the "
            "engine's pool sizes, which this snapshot does not have",
        ]
        return {
            "binding_constraint": self.constraint,
            "cause": self.cause,
            "notes": self.notes,
            "evidence": self.readings.evidence(*EVIDENCE),
            "unread_evidence": [],
            "missing_evidence": self.missing,
            "recommendation": {"flags": {}, "client_concurrency": None, "predicted": None,
                               "chosen": None, "reasons": reasons, "options": []},
            "memory_model": {"measured": [], "current": None},
        }


def missing_evidence(snapshot: Mapping[str, Any]) -> list[str]:
    """The snapshot sections a fuller diagnosis would use, each with what it would add."""
    wanted = {
        "gpu": "GPU memory (NVML: the snapshot's gpu section, or --gpu-memory-mib): needed for "
               "any flag recommendation",
        "log": "the engine log's startup lines (Mamba and KV pool sizes, weights, the "
               "scheduler's max_running_requests): calibrate the memory model and name the cap's "
               "cause",
        "server_info": "/server_info (effective cap per scheduler, resolved mem_fraction_static, "
                       "SGLang version)",
        "profile": "the launch profile (the flags the engine was started with)",
    }
    return [text for key, text in wanted.items() if not snapshot.get(key)]


def classify_readings(readings: Readings) -> tuple[str, str, list[str]]:
    """(constraint, cause, notes) from running, queue and usage readings alone."""
    queued, kv = readings.get("queued"), readings.get("kv_usage")
    running, cap = readings.get("running"), readings.get("effective_cap")
    if queued > 0 and kv is not None and kv >= KV_HIGH:
        return "kv_capacity", "kv_pool_full", []
    if queued == 0:
        return "client_concurrency", "engine_queue_empty", []
    if (readings.get("mamba_usage") or 0) >= MAMBA_HIGH:
        return "running_cap", "mamba_slots", []
    notes = [f"{queued} requests wait while {running} run and the KV pool is "
             f"{'not read' if kv is None else f'{kv:.0%} used'}: the scheduler's running cap "
             "binds, not memory"]
    if cap:
        notes.append(f"the effective cap is {cap}")
    return "running_cap", "cap_cause_unknown", notes


def diagnose_partial(snapshot: Mapping[str, Any], why: str) -> PartialDiagnosis:
    """Diagnose from the readings only; ``why`` says what stopped the full diagnosis."""
    readings = read_snapshot(snapshot)
    constraint, cause, notes = classify_readings(readings)
    notes.append(f"partial diagnosis: {why}")
    return PartialDiagnosis(constraint, cause, readings, missing_evidence(snapshot), notes)
