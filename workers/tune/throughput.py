"""How output throughput grows with the number of running requests, per GPU, from steady state.

A saturating curve ``tok_s(n) = peak * n / (n + half)``: linear while the GPU has spare
compute, flat past the knee. Its evidence is the engine at steady state only: decode lines (or
sampled ``sglang:num_running_reqs`` / ``sglang:gen_throughput`` gauges) taken while the engine
ran at its own running cap with requests queued, so that the cap, not the client or a ramp,
held the running count. Warm-up lines are not evidence: while requests are admitted or drain,
the running count a line reports is not the one its interval ran at, and its
``gen throughput`` (tokens since the previous decode line over the time since then,
``SchedulerMetricsMixin.log_decode_stats``) also covers idle time and prefill.

One engine start gives one steady running count (its cap); earlier starts in the same log (a
canary relaunch at another cap) give more. A knee needs at least ``MIN_KNEE_COUNTS`` distinct
counts spanning ``MIN_SPAN``; "flat" (compute-bound) at least two such counts. With less, the
curve above the highest measured count is unmeasured: ``knee()`` is None, predictions above
that count assume the shape of the observed run's curve and say so, and the running cap is
sized by memory, then checked on a canary (``tune auto``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workers.engine.log import BatchLine

# Past the knee one more running request adds less than this share of the average
# per-request throughput: the marginal gain is half / (n + half).
KNEE_MARGINAL_SHARE = 0.25
# Running within this share of the cap (at least one request) counts as at the cap.
AT_CAP_SLACK = 0.05
# Distinct steady-state running counts needed before a fitted knee is evidence.
MIN_KNEE_COUNTS = 3
# The steady-state running counts must span this ratio (largest / smallest).
MIN_SPAN = 1.5
# A canary trial keeps a new profile only if the engine's measured rate rises by this share
# (``workers.tune.apply.MIN_GAIN``, kept equal by a test).
CANARY_MIN_GAIN = 0.05
# Two counts are flat when the larger gives less than this share more tokens per second: the
# gain a canary would have rolled back.
FLAT_GAIN = CANARY_MIN_GAIN


@dataclass(frozen=True)
class ThroughputModel:
    """``tok_s(n) = peak * n / (n + half)``, with where its numbers came from.

    ``measured_up_to`` is the highest steady-state running count behind it (0: none);
    ``shape_measured`` says whether the knee (or flatness) itself was measured.
    """

    peak_tok_s: float
    half_n: float
    source: str
    measured_up_to: float = 0.0
    shape_measured: bool = False

    def tok_s(self, running: float) -> float:
        """Predicted output tokens per second with ``running`` requests."""
        return self.peak_tok_s * running / (running + self.half_n) if running > 0 else 0.0

    def marginal_share(self, running: float) -> float:
        """Gain of one more request as a share of the current per-request rate."""
        return self.half_n / (running + self.half_n)

    def knee(self) -> int | None:
        """Running requests past which more of them barely pay off; None when unmeasured."""
        if not self.shape_measured:
            return None
        return max(1, round(self.half_n * (1 / KNEE_MARGINAL_SHARE - 1)))

    def saturated_at(self, running: float) -> bool:
        """Whether measured steady state shows one more request barely adds throughput."""
        return self.shape_measured and self.marginal_share(running) < KNEE_MARGINAL_SHARE


WORKLOAD = ThroughputModel(
    peak_tok_s=7000.0,
    half_n=40.0,
    source="the observed run: ~2,000 tok/s at 16 running, ~3,500 at 40",
)


def at_cap(running: float, cap: float) -> bool:
    """Whether ``running`` is at ``cap`` (within AT_CAP_SLACK, at least one request)."""
    return cap > 0 and running >= cap - max(1, round(cap * AT_CAP_SLACK))


def steady(running: float | None, queued: float | None, cap: float) -> bool:
    """Whether the engine ran at its cap with requests waiting (the cap held the count)."""
    return bool(running and queued and queued > 0 and at_cap(running, cap))


def steady_decode_points(lines: Sequence[BatchLine], cap: float) -> list[tuple[float, float]]:
    """(running, tok/s) of the decode lines taken at steady state under ``cap``.

    A line counts when it and the decode line before it were both at the cap with a queue:
    the first line at the cap after a ramp covers the ramp (and any idle time before it).
    """
    points = []
    previous = False
    for line in lines:
        running, queued = line.number("#running-req"), line.number("#queue-req")
        tok_s = line.number("gen throughput (token/s)")
        now = steady(running, queued, cap)
        if now and previous and running and tok_s:
            points.append((running, tok_s))
        previous = now
    return points


def _number(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def steady_sample_points(samples: Iterable[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """(running, tok/s) of sampled gauges at steady state, oldest sample first.

    Each sample holds ``/v1/loads`` fields and, under ``metrics``, the ``sglang:`` gauges.
    ``sglang:gen_throughput`` is set at each decode log line, together with
    ``sglang:num_running_reqs`` / ``num_queue_reqs`` (the prefill log line sets those two
    without the throughput), so a new throughput value marks one decode line: it counts once,
    read with the gauges beside it, under the same rule as :func:`steady_decode_points`.
    """
    points = []
    last, previous = None, False
    for sample in samples:
        gauges = sample.get("metrics")
        gauges = gauges if isinstance(gauges, Mapping) else {}
        tok_s = _number(gauges.get("sglang:gen_throughput"))
        if tok_s is None or tok_s == last:
            continue
        last = tok_s
        cap = _number(sample.get("max_running_requests")) or 0.0
        running = _number(gauges.get("sglang:num_running_reqs"))
        now = steady(running, _number(gauges.get("sglang:num_queue_reqs")), cap)
        if now and previous and running and tok_s:
            points.append((running, tok_s))
        previous = now
    return points


def _grouped(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    by_n: dict[float, list[float]] = {}
    for n, tok_s in points:
        if n > 0 and tok_s > 0:
            by_n.setdefault(n, []).append(tok_s)
    return sorted((n, sum(v) / len(v)) for n, v in by_n.items())


def _least_squares(grouped: list[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of ``1/y = 1/peak + (half/peak) / n``."""
    xs = [1 / n for n, _ in grouped]
    ys = [1 / y for _, y in grouped]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx


def fit(
    points: Iterable[tuple[float, float]], prior: ThroughputModel = WORKLOAD
) -> ThroughputModel:
    """The curve for steady-state (running, tok/s) points; the prior's shape where unmeasured.

    ``points`` must already be steady state (:func:`steady_decode_points`,
    :func:`steady_sample_points`). Flat: two or more counts spanning MIN_SPAN where the larger
    gives under FLAT_GAIN more (or a least-squares slope <= 0). A knee: MIN_KNEE_COUNTS or
    more counts over MIN_SPAN whose fit saturates. Anything less measures throughput up to the
    highest count and nothing above it: two rising counts give the curve through both, one
    count scales the prior's shape to it; either way ``knee()`` is None.
    """
    grouped = _grouped(points)
    if not grouped:
        return prior
    label = ", ".join(f"{n:g}->{y:.0f}" for n, y in grouped)
    (lo_n, lo_y), (hi_n, hi_y) = grouped[0], grouped[-1]
    wide = len(grouped) >= 2 and hi_n >= lo_n * MIN_SPAN
    slope, intercept = _least_squares(grouped) if len(grouped) >= 2 else (0.0, 0.0)
    if wide and (hi_y < lo_y * (1 + FLAT_GAIN) or slope <= 0):
        peak = max(y for _, y in grouped)
        return ThroughputModel(peak, 0.0, f"flat over steady state {label} tok/s", hi_n, True)
    if wide and len(grouped) >= MIN_KNEE_COUNTS and intercept > 0 and slope > 0:
        return ThroughputModel(
            1 / intercept, slope / intercept, f"fit to steady state {label} tok/s", hi_n, True
        )
    unmeasured = f"unmeasured above {hi_n:g} running"
    if wide and intercept > 0 and slope > 0:
        return ThroughputModel(
            1 / intercept, slope / intercept,
            f"steady state {label} tok/s; too few running counts for a knee, {unmeasured}",
            hi_n,
        )
    peak = hi_y * (hi_n + prior.half_n) / hi_n
    return ThroughputModel(
        peak, prior.half_n,
        f"steady state {label} tok/s; {unmeasured} (shape of {prior.source} assumed)",
        hi_n,
    )
