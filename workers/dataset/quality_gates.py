"""The quality gates of a job: thresholds on the figures of :mod:`workers.dataset.quality`.

Set at enqueue with ``--quality KEY=VALUE`` (recorded in ``job.json``), overridden at
``verify`` the same way. Every gate is a largest share (0..1, or a percentage such as ``1%``)
of its figure; ``near_empty_tokens`` is the token count under which an answer is near-empty.
A gate set to ``1`` (or ``100%``) is off. A failed gate names its figure, its threshold and up
to five example row ids. Defaults are what a team once burnt by an empty data set would want.
"""

from __future__ import annotations

from typing import Any

from workers.errors import InputError

# gate -> (figure it bounds, default largest share)
GATES: dict[str, tuple[str, float]] = {
    "near_empty": ("near_empty", 0.01),
    "truncated": ("truncated", 0.05),
    "failed_or_quarantined": ("failed_or_quarantined", 0.01),
    "no_reasoning": ("no_reasoning", 0.01),
    "markers": ("markers", 0.01),
    "identical": ("identical", 0.02),
    "same_samples": ("same_samples", 0.05),
}
NEAR_EMPTY_TOKENS = 10
KEYS = (*GATES, "near_empty_tokens")


def defaults() -> dict[str, float]:
    """Every threshold at its default."""
    return {**{g: share for g, (_, share) in GATES.items()},
            "near_empty_tokens": NEAR_EMPTY_TOKENS}


def _value(key: str, raw: str, where: str) -> float:
    text = raw.strip()
    pct = text.endswith("%")
    try:
        value = float(text[:-1] if pct else text)
    except ValueError:
        raise InputError(where, None, f"{key}={raw!r}: not a number") from None
    if key == "near_empty_tokens":
        if pct or value < 0 or value != int(value):
            raise InputError(where, None, f"{key}={raw!r}: a whole number of tokens")
        return int(value)
    value = value / 100 if pct else value
    if not 0 <= value <= 1:
        raise InputError(where, None, f"{key}={raw!r}: a share between 0 and 1 (or 0%..100%)")
    return value


def parse_quality(items: list[str] | None, where: str = "--quality") -> dict[str, float]:
    """The thresholds ``--quality KEY=VALUE`` sets (only those given); InputError naming the
    key for anything else."""
    out: dict[str, float] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise InputError(where, None, f"{item!r}: use KEY=VALUE")
        if key not in KEYS:
            raise InputError(where, None, f"unknown gate {key!r} (known: {', '.join(KEYS)})")
        out[key] = _value(key, raw, where)
    return out


def thresholds(recorded: dict[str, float] | None, override: dict[str, float] | None = None
               ) -> dict[str, float]:
    """The thresholds in force: defaults, then the job's recorded ones, then ``override``."""
    return {**defaults(), **(recorded or {}), **(override or {})}


def evaluate(quality: dict[str, Any], limits: dict[str, float]) -> list[dict[str, Any]]:
    """The failed gates of ``quality`` (a :meth:`QualityTally.report`) under ``limits``: each
    with its figure (share and count of how many), threshold and example row ids."""
    failed = []
    figures = quality.get("figures", {})
    for gate, (figure, _) in GATES.items():
        fig = figures.get(figure)
        limit = float(limits.get(gate, GATES[gate][1]))
        if not fig or not fig["of"] or limit >= 1:
            continue
        if fig["share"] > limit:
            failed.append({"gate": gate, "share": fig["share"], "count": fig["count"],
                           "of": fig["of"], "threshold": limit, "examples": fig["examples"]})
    return failed


def gate_line(gate: dict[str, Any]) -> str:
    """One failed gate in words: ``near_empty 87.0 % (870 of 1,000) > 1.0 %; e.g. r1, r2``."""
    ex = ", ".join(gate["examples"])
    return (f"{gate['gate']} {gate['share'] * 100:.1f} % ({gate['count']:,} of {gate['of']:,})"
            f" > {gate['threshold'] * 100:.1f} %" + (f"; e.g. {ex}" if ex else ""))


def summary(failed: list[dict[str, Any]]) -> str:
    """``quality: ok`` or ``quality: 2 gates failed``."""
    if not failed:
        return "quality: ok"
    return f"quality: {len(failed)} gate{'s' if len(failed) > 1 else ''} failed"
