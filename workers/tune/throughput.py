"""How output throughput grows with the number of running requests, per GPU.

A saturating curve ``tok_s(n) = peak * n / (n + half)``: linear while the GPU has spare
compute, flat past the knee. Its two numbers come from measurements when there are any
(decode log lines, trial windows) and otherwise from the observed workload
(the observed run: about 2,000 tok/s at 16 running and 3,500 at 40, which gives
``half = 40`` and ``peak = 7,000``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Past the knee one more running request adds less than this share of the average
# per-request throughput: the marginal gain is half / (n + half).
KNEE_MARGINAL_SHARE = 0.25


@dataclass(frozen=True)
class ThroughputModel:
    """``tok_s(n) = peak * n / (n + half)``, with where its numbers came from."""

    peak_tok_s: float
    half_n: float
    source: str

    def tok_s(self, running: float) -> float:
        """Predicted output tokens per second with ``running`` requests."""
        return self.peak_tok_s * running / (running + self.half_n) if running > 0 else 0.0

    def marginal_share(self, running: float) -> float:
        """Gain of one more request as a share of the current per-request rate."""
        return self.half_n / (running + self.half_n)

    def knee(self) -> int:
        """Running requests past which more of them barely pay off."""
        return max(1, round(self.half_n * (1 / KNEE_MARGINAL_SHARE - 1)))


WORKLOAD = ThroughputModel(
    peak_tok_s=7000.0,
    half_n=40.0,
    source="the observed run: ~2,000 tok/s at 16 running, ~3,500 at 40",
)


def _grouped(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    by_n: dict[float, list[float]] = {}
    for n, tok_s in points:
        if n > 0 and tok_s > 0:
            by_n.setdefault(n, []).append(tok_s)
    return sorted((n, sum(v) / len(v)) for n, v in by_n.items())


def fit(
    points: Iterable[tuple[float, float]], prior: ThroughputModel = WORKLOAD
) -> ThroughputModel:
    """Fit the curve to (running, tok/s) points; few or degenerate points keep the prior's knee.

    Two or more distinct running counts: least squares on ``1/y = 1/peak + (half/peak) / n``.
    Throughput that does not grow with n gives a flat curve (``half = 0``). One count (or
    points that grow faster than linearly): keep the prior's ``half`` and scale ``peak``.
    """
    grouped = _grouped(points)
    if not grouped:
        return prior
    label = ", ".join(f"{n:g}->{y:.0f}" for n, y in grouped)
    if len(grouped) >= 2:
        xs = [1 / n for n, _ in grouped]
        ys = [1 / y for _, y in grouped]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        intercept = my - slope * mx
        if intercept > 0 and slope > 0:
            return ThroughputModel(1 / intercept, slope / intercept, f"fit to {label} tok/s")
        if slope <= 0:  # more running requests gave no more tokens: saturated
            peak = max(y for _, y in grouped)
            return ThroughputModel(peak, 0.0, f"flat over {label} tok/s")
    n, y = grouped[-1]
    peak = y * (n + prior.half_n) / n
    return ThroughputModel(peak, prior.half_n, f"scaled to {label} tok/s, knee of {prior.source}")
