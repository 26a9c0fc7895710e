"""Apply a launch profile one GPU at a time: canary, measure, keep or roll back, roll out.

"One GPU" is one worker: a GPU group (``gpu0-1``, one tensor-parallel engine) restarts as a
whole, and the rollout reaches the next worker only once that group's engine is healthy.

The fleet never stops as a whole: only the canary restarts during a trial (its in-flight
prompts go back to its batch and are retried by the worker), and a kept profile reaches the
other workers one at a time, each healthy again before the next one restarts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from config.launch_profile import LaunchProfile
from workers.tune.fleet import Fleet, Measurement, Timing, TuneError

log = logging.getLogger(__name__)

# A new profile is kept only if the canary's throughput rises by at least this share.
MIN_GAIN = 0.05


@dataclass
class Trial:
    """One canary trial of a profile."""

    node: str
    old: str
    new: str
    before_tok_s: float
    after_tok_s: float | None
    kept: bool
    reason: str
    measured: dict[str, Any] | None = None  # the after-window, plain and saturated

    def to_json(self) -> dict[str, Any]:
        """JSON form for reports."""
        return {
            "node": self.node,
            "old_profile": self.old,
            "new_profile": self.new,
            "before_tok_s": round(self.before_tok_s, 1),
            "after_tok_s": None if self.after_tok_s is None else round(self.after_tok_s, 1),
            "kept": self.kept,
            "reason": self.reason,
            "measured": self.measured,
        }


@dataclass
class ApplyReport:
    """What ``apply`` did."""

    trial: Trial
    rolled_out: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """JSON form printed by the CLI."""
        return {"trial": self.trial.to_json(), "rolled_out": self.rolled_out}


def is_better(before_tok_s: float, after_tok_s: float, min_gain: float = MIN_GAIN) -> bool:
    """Whether ``after`` beats ``before`` by at least ``min_gain``."""
    return after_tok_s >= before_tok_s * (1 + min_gain)


def measure_busy(fleet: Fleet, node: str, timing: Timing) -> Measurement:
    """Wait until ``node``'s engine is full, then measure its throughput."""
    if not fleet.wait_busy(node, timing.settle_timeout_s, timing.poll_s):
        log.warning("%s never filled its running cap; measuring anyway", node)
    return fleet.measure(node, timing.window_s)


def switch(fleet: Fleet, node: str, profile: LaunchProfile, timing: Timing) -> None:
    """Restart ``node``'s engine with ``profile`` and wait until it is healthy."""
    fleet.relaunch(node, profile)
    fleet.wait_profile(node, profile.name, timing.restart_timeout_s)


def run_trial(
    fleet: Fleet,
    node: str,
    old: LaunchProfile,
    new: LaunchProfile,
    timing: Timing,
    before_tok_s: float | None = None,
    min_gain: float = MIN_GAIN,
) -> Trial:
    """Try ``new`` on ``node``; keep it if throughput rises by ``min_gain``, else roll back."""
    before = before_tok_s if before_tok_s is not None else measure_busy(fleet, node, timing).rate
    try:
        switch(fleet, node, new, timing)
        measured = measure_busy(fleet, node, timing)
    except TuneError as exc:
        log.warning("trial of %s on %s failed: %s; rolling back", new.name, node, exc)
        switch(fleet, node, old, timing)
        return Trial(node, old.name, new.name, before, None, False, f"failed: {exc}")
    after = measured.rate
    # Say when the new profile was never measured at its cap (the client kept fewer in flight).
    unsteady = "" if measured.steady else (
        f" (engine full for {measured.saturated_share:.0%} of the window: not at steady "
        f"state, whole-window rate compared)"
    )
    if is_better(before, after, min_gain):
        reason = f"{after:.0f} vs {before:.0f} tok/s (x{after / before:.2f}){unsteady}"
        return Trial(node, old.name, new.name, before, after, True, reason, measured.to_json())
    switch(fleet, node, old, timing)
    reason = (
        f"{after:.0f} vs {before:.0f} tok/s: below the {min_gain:.0%} bar, rolled back{unsteady}"
    )
    return Trial(node, old.name, new.name, before, after, False, reason, measured.to_json())


def roll_out(fleet: Fleet, profile: LaunchProfile, nodes: list[str], timing: Timing) -> list[str]:
    """Switch ``nodes`` to ``profile`` one at a time; returns those switched."""
    done = []
    for node in nodes:
        if fleet.heartbeat(node).get("profile") == profile.name:
            continue
        switch(fleet, node, profile, timing)
        done.append(node)
    return done


def group_size(beat: dict[str, Any]) -> int:
    """How many GPUs a worker's engine runs on (1 for a heartbeat without ``gpus``)."""
    return len(beat.get("gpus") or [beat.get("gpu")])


def peers(fleet: Fleet, node: str) -> list[str]:
    """The other live workers a profile kept on ``node`` may be rolled out to: those whose
    engines span as many GPUs (a profile measured at tp-size 2 says nothing of one GPU's
    memory, and the other way round)."""
    beats = fleet.nodes()
    size = next((group_size(b) for b in beats if b["node"] == node), 1)
    skipped = [b["node"] for b in beats if b["node"] != node and group_size(b) != size]
    if skipped:
        log.info("not rolled out to %s: engines of another GPU count than %s", skipped, node)
    return [b["node"] for b in beats if b["node"] != node and group_size(b) == size]


def pick_canary(fleet: Fleet, canary: str | None) -> str:
    """The canary's node name: as given (a node name, or the queue of its GPU or GPU group:
    ``gpu3``, ``gpu0-1``), else the first healthy."""
    beats = fleet.nodes()
    if canary is not None:
        for beat in beats:
            queues = {f"gpu{beat.get('group', beat['gpu'])}", beat.get("queue")}
            if canary == beat["node"] or canary in queues:
                return str(beat["node"])
        raise TuneError(f"no live worker matches {canary!r}")
    healthy = [b["node"] for b in beats if b.get("engine_state") == "healthy"]
    if not healthy:
        raise TuneError("no healthy worker to use as a canary")
    return str(healthy[0])


def apply_profile(
    fleet: Fleet, profile: LaunchProfile, canary: str | None, timing: Timing
) -> ApplyReport:
    """Canary ``profile`` and roll it out to every other worker if it is better."""
    node = pick_canary(fleet, canary)
    old = fleet.profile_of(node)
    trial = run_trial(fleet, node, old, profile, timing)
    report = ApplyReport(trial)
    if trial.kept:
        report.rolled_out = roll_out(fleet, profile, peers(fleet, node), timing)
    return report
