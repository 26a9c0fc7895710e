"""``tune auto``: snapshot the canary, diagnose, try the recommendation, repeat, roll out.

Each round turns the diagnosis into a new launch profile (the current one with the
recommended flag changes), trials it on the canary, and stops at the first trial that does
not pay off (it is rolled back) or when nothing is left to change. The best profile then
reaches the other workers one at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from config.launch_profile import LaunchProfile
from workers.tune.apply import Trial, measure_busy, peers, pick_canary, roll_out, run_trial
from workers.tune.diagnose import Diagnosis, diagnose
from workers.tune.flags import apply_changes
from workers.tune.fleet import Fleet, Timing
from workers.tune.partial import PartialDiagnosis

log = logging.getLogger(__name__)

MAX_TRIALS = 3


@dataclass
class AutoReport:
    """What ``tune auto`` did and what it gained."""

    canary: str
    start_profile: str
    final_profile: str
    start_tok_s: float
    final_tok_s: float
    trials: list[Trial] = field(default_factory=list)
    diagnoses: list[dict[str, Any]] = field(default_factory=list)
    rolled_out: list[str] = field(default_factory=list)

    @property
    def gain(self) -> float:
        """Final over starting throughput on the canary."""
        return self.final_tok_s / self.start_tok_s if self.start_tok_s else 0.0

    def to_json(self) -> dict[str, Any]:
        """JSON form printed by the CLI."""
        return {
            "canary": self.canary,
            "start_profile": self.start_profile,
            "final_profile": self.final_profile,
            "start_tok_s": round(self.start_tok_s, 1),
            "final_tok_s": round(self.final_tok_s, 1),
            "gain": round(self.gain, 3),
            "trials": [t.to_json() for t in self.trials],
            "diagnoses": self.diagnoses,
            "rolled_out": self.rolled_out,
        }


def base_name(name: str) -> str:
    """A profile name without the tuner's ``-tuneN`` suffix."""
    head, sep, tail = name.rpartition("-tune")
    return head if sep and tail.isdigit() else name


def next_profile(
    current: LaunchProfile, diagnosis: Diagnosis, round_: int, allow_lossy: bool = False
) -> LaunchProfile | None:
    """The profile the diagnosis recommends, or None when there is nothing to try.

    When the client is the limit the engine needs no restart; only a client concurrency that
    the profile itself pins too low is worth changing. Lossy levers (bf16 SSM state, FP8 KV)
    are tried only with ``allow_lossy``.
    """
    rec = diagnosis.recommendation
    changes = rec.flags
    if (
        not allow_lossy
        and rec.chosen
        and any(o.lossy and o.name == rec.chosen for o in rec.options)
    ):
        changes = {}  # an accuracy trade-off is advice for a person, not for auto
    concurrency = current.client_concurrency
    if diagnosis.verdict.constraint == "client_concurrency":
        if concurrency is None or rec.client_concurrency is None:
            return None
        concurrency = max(concurrency, rec.client_concurrency)
    flags = apply_changes(current.flags, changes)
    if flags == current.flags and concurrency == current.client_concurrency:
        return None
    summary = ", ".join(f"{k}={v}" for k, v in changes.items()) or "client concurrency"
    return current.model_copy(
        update={
            "name": f"{base_name(current.name)}-tune{round_}",
            "description": f"tune auto round {round_} from {current.name}: {summary}",
            "flags": flags,
            "client_concurrency": concurrency,
        }
    )


def auto(
    fleet: Fleet,
    canary: str | None,
    timing: Timing,
    max_trials: int = MAX_TRIALS,
    allow_lossy: bool = False,
) -> AutoReport:
    """Tune the canary round by round, then roll the best profile out to the others."""
    node = pick_canary(fleet, canary)
    current = fleet.profile_of(node)
    start = measure_busy(fleet, node, timing).rate
    report = AutoReport(node, current.name, current.name, start, start)
    for round_ in range(1, max_trials + 1):
        diagnosis = diagnose(fleet.snapshot(node))
        report.diagnoses.append(diagnosis.to_json())
        if isinstance(diagnosis, PartialDiagnosis):
            break  # no memory arithmetic without the GPU's memory: nothing to try
        new = next_profile(current, diagnosis, round_, allow_lossy)
        if new is None:
            break
        fleet.book.remember(new)
        trial = run_trial(fleet, node, current, new, timing, before_tok_s=report.final_tok_s)
        report.trials.append(trial)
        log.info("round %d: %s", round_, trial.reason)
        if not trial.kept or trial.after_tok_s is None:
            break
        current, report.final_profile, report.final_tok_s = new, new.name, trial.after_tok_s
    if report.final_profile != report.start_profile:
        report.rolled_out = roll_out(fleet, current, peers(fleet, node), timing)
    return report
