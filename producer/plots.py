"""The report's PNG plots (matplotlib's object API: no pyplot, no display, no global state)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

SIZE_IN = (8.0, 4.0)
DPI = 110


def _figure(title: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="tight")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path)
    return path


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes)


# Bucket widths the time plots choose from: the smallest that keeps a job within MAX_BUCKETS.
BUCKET_LADDER_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400)
MAX_BUCKETS = 60


def bucket_width_s(span_s: float) -> int:
    """The bucket width for a job that ran ``span_s`` seconds: about 60 points over its
    length (a 7-s demo gets 1-s buckets, a 30-h job 30-min ones)."""
    for width in BUCKET_LADDER_S:
        if span_s / width <= MAX_BUCKETS:
            return width
    return BUCKET_LADDER_S[-1]


def _axis(span_s: float) -> tuple[float, str]:
    """Divisor and unit of the time axis: seconds for a short job, minutes, then hours."""
    if span_s < 180:
        return 1.0, "seconds"
    if span_s < 3 * 3600:
        return 60.0, "minutes"
    return 3600.0, "hours"


def _width_label(width: int) -> str:
    return f"{width}-s" if width < 60 else f"{width // 60}-min"


def throughput(node_tokens: dict[str, dict[int, int]], width: int, path: Path) -> Path:
    """Output tokens/s over time, one line per GPU worker and one for the total;
    ``node_tokens`` maps node -> bucket start (s since the first result) -> tokens."""
    fig, ax = _figure(f"output tokens/s per GPU ({_width_label(width)} buckets)")
    buckets = sorted({b for series in node_tokens.values() for b in series})
    if not buckets:
        _no_data(ax, "throughput")
        return _save(fig, path)
    every = list(range(0, buckets[-1] + width, width))
    div, unit = _axis(every[-1] + width)
    xs = [(b + width / 2) / div for b in every]
    style = {"marker": "o", "markersize": 3} if len(every) < 3 else {}
    for node in sorted(node_tokens):
        series = node_tokens[node]
        ax.plot(xs, [series.get(b, 0) / width for b in every], label=node, linewidth=1.2,
                **style)
    total = [sum(s.get(b, 0) for s in node_tokens.values()) / width for b in every]
    ax.plot(xs, total, label="total", color="black", linestyle="--", **style)
    ax.set_xlabel(f"{unit} since the first result")
    ax.set_ylabel("output tokens/s")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize="small")
    return _save(fig, path)


def progress(rows: dict[int, int], width: int, status: dict[str, Any], path: Path) -> Path:
    """Prompts finished over time against the total, with the projection to the ETA;
    ``rows`` maps bucket start (s since the first result) -> prompts finished in it."""
    fig, ax = _figure(f"progress of job {status['job']}")
    if not rows:
        _no_data(ax, "progress")
        return _save(fig, path)
    ends = list(range(width, max(rows) + 2 * width, width))
    cumulative, done = [], 0
    for end in ends:
        done += rows.get(end - width, 0)
        cumulative.append(done)
    eta_h = status.get("eta_hours")
    projecting = not status["done"] and eta_h
    last = ends[-1] + (eta_h * 3600 if projecting else 0)
    div, unit = _axis(last)
    ax.plot([0.0] + [e / div for e in ends], [0, *cumulative], marker=".",
            label="finished prompts")
    ax.axhline(status["total"], color="grey", linestyle=":", label=f"total {status['total']:,}")
    if projecting:
        ax.plot([ends[-1] / div, last / div], [cumulative[-1], status["total"]],
                linestyle="--", color="tab:orange", label=f"ETA in {eta_h * 60:.1f} min")
    ax.set_xlabel(f"{unit} since the first result")
    ax.set_ylabel("prompts")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize="small")
    return _save(fig, path)


def histogram(values: list[float] | list[int], label: str, path: Path) -> Path:
    """Distribution of one per-prompt number."""
    fig, ax = _figure(f"{label}: distribution over prompts")
    if values:
        ax.hist(values, bins=min(50, max(5, len(values) // 10)), color="tab:blue", alpha=0.8)
    else:
        _no_data(ax, label)
    ax.set_xlabel(label)
    ax.set_ylabel("prompts")
    return _save(fig, path)


def bars(counts: Counter[str], label: str, path: Path) -> Path:
    """A bar per category, largest first."""
    fig, ax = _figure(f"{label}s")
    if counts:
        names, values = zip(*counts.most_common(), strict=True)
        ax.bar(names, values, color="tab:green")
        for i, v in enumerate(values):
            ax.annotate(f"{v:,}", (i, v), ha="center", va="bottom", fontsize="small")
    else:
        _no_data(ax, label)
    ax.set_ylabel("prompts")
    return _save(fig, path)


def quality(q: dict[str, Any] | None, path: Path) -> Path:
    """The data set's quality (manifest ``quality``): completion tokens of the answered rows
    (log-spaced buckets; the near-empty threshold marked), and each gate's share beside its
    threshold."""
    fig = Figure(figsize=(SIZE_IN[0] * 1.6, SIZE_IN[1]), dpi=DPI, layout="tight")
    left, right = fig.subplots(1, 2)
    fig.suptitle("quality of the data set")
    hist = (q or {}).get("histogram") or []
    if hist:
        edges = [max(lo, 1) for lo, _ in hist]
        left.bar(edges, [n for _, n in hist], width=[max(e * 0.05, 0.8) for e in edges],
                 color="tab:blue", align="edge")
        left.set_xscale("log")
        left.axvline(max(q.get("near_empty_tokens", 10), 1), color="tab:red", ls="--",
                     label=f"near-empty (< {q.get('near_empty_tokens', 10)} tokens)")
        left.legend(fontsize="small")
    else:
        _no_data(left, "completion tokens")
    left.set_xlabel("completion tokens")
    left.set_ylabel("answered rows")
    figures, limits = (q or {}).get("figures") or {}, (q or {}).get("thresholds") or {}
    gates = [g for g in limits if g in figures]
    if gates:
        shares = [100 * figures[g]["share"] for g in gates]
        colors = ["tab:red" if figures[g]["share"] > limits[g] else "tab:green" for g in gates]
        right.barh(gates, shares, color=colors)
        right.scatter([100 * min(limits[g], 1) for g in gates], gates, marker="|", s=300,
                      color="black", label="threshold")
        right.legend(fontsize="small")
    else:
        _no_data(right, "quality gates")
    right.set_xlabel("% of its rows")
    return _save(fig, path)
