"""The report's PNG plots (matplotlib's object API: no pyplot, no display, no global state)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from workers.delivery.jobstate import SERIES_BUCKET_S

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


def _minutes(buckets: list[int], t0: float) -> list[float]:
    """Bucket midpoints as minutes since ``t0``."""
    return [(b + SERIES_BUCKET_S / 2 - t0) / 60 for b in buckets]


def throughput(node_tokens: dict[str, dict[int, int]], path: Path) -> Path:
    """Output tokens/s over time, one line per GPU worker and one for the total."""
    fig, ax = _figure("output tokens/s per GPU (10-s buckets)")
    buckets = sorted({b for series in node_tokens.values() for b in series})
    if not buckets:
        _no_data(ax, "throughput")
        return _save(fig, path)
    t0 = buckets[0]
    for node in sorted(node_tokens):
        series = node_tokens[node]
        ax.plot(_minutes(buckets, t0), [series.get(b, 0) / SERIES_BUCKET_S for b in buckets],
                label=node, linewidth=1.2)
    total = [sum(s.get(b, 0) for s in node_tokens.values()) / SERIES_BUCKET_S for b in buckets]
    ax.plot(_minutes(buckets, t0), total, label="total", color="black", linestyle="--")
    ax.set_xlabel("minutes since the first result")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize="small")
    return _save(fig, path)


def progress(rows: dict[int, int], status: dict[str, Any], path: Path) -> Path:
    """Prompts finished over time against the total, with the projection to the ETA."""
    fig, ax = _figure(f"progress of job {status['job']}")
    buckets = sorted(rows)
    if not buckets:
        _no_data(ax, "progress")
        return _save(fig, path)
    t0 = buckets[0]
    done, cumulative = 0, []
    for b in buckets:
        done += rows[b]
        cumulative.append(done)
    ends = [0.0] + [(b + SERIES_BUCKET_S - t0) / 60 for b in buckets]
    ax.plot(ends, [0, *cumulative], label="finished prompts")
    ax.axhline(status["total"], color="grey", linestyle=":", label=f"total {status['total']:,}")
    eta_h = status.get("eta_hours")
    if not status["done"] and eta_h:
        now_min = (time.time() - t0) / 60
        ax.plot([now_min, now_min + eta_h * 60], [cumulative[-1], status["total"]],
                linestyle="--", color="tab:orange", label=f"ETA in {eta_h * 60:.1f} min")
    ax.set_xlabel("minutes since the first result")
    ax.set_ylabel("prompts")
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
