"""The quality gates of a job: thresholds on the figures of :mod:`workers.dataset.quality`.

Set at enqueue with ``--quality KEY=VALUE`` (recorded in ``job.json``), overridden at
``verify`` the same way. Every gate is a largest share (0..1, or a percentage such as ``1%``)
of its figure; ``near_empty_tokens`` is the token count under which an answer is near-empty.
A gate set to ``1`` (or ``100%``) is off. A failed gate names its figure, its threshold and up
to five example row ids. Defaults are what a team once burnt by an empty data set would want.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workers.errors import InputError

EXAMPLES = 5  # example row ids kept per figure


@dataclass(frozen=True)
class FigureDef:
    """One quality figure: the counter it is a share of, the default of its gate (None: no
    gate of its own), whether it is counted row by row (so the live tally has it too), for a
    figure that adds others up, which, and what it says of a row (the reason a row is left
    out of an export by ``--usable-only``)."""

    of: str
    gate: float | None
    per_row: bool = True
    sum_of: tuple[str, ...] = ()
    about: str = ""


# The figures and their gates, declared once: QualityTally counts them, its report and the
# live tally share them out by the same rule (:func:`shares`), evaluate() gates them. A gate
# bounds the figure of its own name. Denominators: ``rows`` every row, ``texts`` answered rows
# judged by their text, ``formed`` answered rows judged by their form (tool calls, structured
# output), ``thinking`` thinking-mode rows; a row cut at max_tokens is counted under
# ``truncated`` alone, so it is none of texts, formed or thinking (workers/dataset/quality.py).
FIGURES: dict[str, FigureDef] = {
    "near_empty": FigureDef("texts", 0.01, about="the answer is blank or under "
                            "near_empty_tokens tokens once the reasoning is split off"),
    "invalid": FigureDef("formed", 0.01, about="its tool calls or structured output do not "
                         "parse or match what was asked"),
    "no_reasoning": FigureDef("thinking", 0.01, about="a thinking-mode row with no reasoning"),
    "markers": FigureDef("thinking", 0.01, about="<think> markers left in the answer"),
    "truncated": FigureDef("rows", 0.05, about="cut at max_tokens (finish_reason length)"),
    "failed": FigureDef("rows", None),
    "quarantined": FigureDef("rows", None),
    "failed_or_quarantined": FigureDef("rows", 0.01, sum_of=("failed", "quarantined")),
    "identical": FigureDef("texts", 0.02, per_row=False),
    "same_samples": FigureDef("prompts_sampled", 0.05, per_row=False),
}
# Figures counted one by one (the others add them up).
COUNTED = tuple(n for n, f in FIGURES.items() if not f.sum_of)
# Figures a single row decides: the live tally's, and what ``requeue --where`` selects by.
PER_ROW = tuple(n for n in COUNTED if FIGURES[n].per_row)
# The counters the denominators name.
COUNTERS = ("rows", "answered", "texts", "formed", "thinking", "prompts_sampled")
GATES: dict[str, float] = {n: f.gate for n, f in FIGURES.items() if f.gate is not None}
NEAR_EMPTY_TOKENS = 10
KEYS = (*GATES, "near_empty_tokens")


def shares(counts: Mapping[str, int], examples: Mapping[str, list[str]],
           names: tuple[str, ...] | None = None) -> dict[str, dict[str, Any]]:
    """Each figure (of ``names``, default all) as the manifest records it: ``count``, ``of``
    (its denominator's counter), ``share`` (0..1) and up to EXAMPLES ``examples``;
    ``counts`` holds the counted figures and the counters."""
    out = {}
    for name in names or tuple(FIGURES):
        fig = FIGURES[name]
        parts = fig.sum_of or (name,)
        n = sum(int(counts.get(p, 0)) for p in parts)
        of = int(counts.get(fig.of, 0))
        ex = [x for p in parts for x in examples.get(p, [])][:EXAMPLES]
        out[name] = {"count": n, "of": of, "share": round(n / of, 6) if of else 0.0,
                     "examples": ex}
    return out


def defaults() -> dict[str, float]:
    """Every threshold at its default."""
    return {**GATES, "near_empty_tokens": NEAR_EMPTY_TOKENS}


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
    for gate, default in GATES.items():
        fig = figures.get(gate)
        limit = float(limits.get(gate, default))
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
