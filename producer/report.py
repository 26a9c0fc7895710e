"""``python -m producer report --job NAME --out DIR``: a Markdown summary with PNG plots.

What it reads, all recorded by the fleet during the run:

- the job's 10-s time series in Redis (``fleet:job:{j}:series:n`` / ``:tok``, one field per
  bucket and one per bucket and GPU, bumped with every recorded row): throughput per GPU and
  progress over time;
- the live counters and ETA (:func:`producer.status.job_status`);
- the stored results (latency, output length and finish reason of every prompt).

It writes ``report.md``, ``summary.json`` and ``throughput.png``, ``progress.png``,
``latency.png``, ``output_length.png``, ``finish_reasons.png`` into DIR.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import redis

from producer import plots
from producer.status import job_status
from workers.dataset.jobs import JobSpec, batch_of_result_key, decode_rows, results_prefix
from workers.dataset.manifest import row_bucket
from workers.dataset.store import Store
from workers.delivery import jobstate

PERCENTILES = (50, 90, 99)


@dataclass
class Series:
    """Rows and output tokens per 10-s bucket, in total and per worker node."""

    rows: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    node_rows: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    node_tokens: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    started_at: float = 0.0

    def span_s(self, now: float) -> float:
        """Seconds of generation: first to last bucket, within the job's start and now."""
        if not self.rows:
            return 0.0
        start = max(min(self.rows), self.started_at)
        end = min(max(self.rows) + jobstate.SERIES_BUCKET_S, now)
        return max(end - start, 1.0)


def _split(raw: dict[bytes, bytes], total: dict[int, int],
           per_node: dict[str, dict[int, int]]) -> None:
    for key, value in raw.items():
        bucket, _, node = key.decode().partition("|")
        if node:
            per_node[node][int(bucket)] = int(value)
        else:
            total[int(bucket)] = int(value)


def read_series(r: redis.Redis, job: str) -> Series:
    """The job's time series from Redis (empty if Redis no longer has it)."""
    keys = jobstate.Keys(job)
    series = Series(started_at=float(r.hget(keys.job, "started_at") or 0))
    _split(r.hgetall(keys.series_n), series.rows, series.node_rows)
    _split(r.hgetall(keys.series_tok), series.tokens, series.node_tokens)
    return series


@dataclass
class RowStats:
    """Per-prompt numbers from the stored results."""

    latency_s: list[float] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    finish: Counter[str] = field(default_factory=Counter)

    def add(self, row: dict[str, Any]) -> None:
        """Count one stored row."""
        kind = row_bucket(row)
        if kind in ("failed", "quarantined"):
            self.finish[kind] += 1
            return
        self.finish[str(row.get("finish_reason") or "unknown")] += 1
        self.output_tokens.append(int(row.get("completion_tokens") or 0))
        if row.get("latency_s") is not None:
            self.latency_s.append(float(row["latency_s"]))


def read_rows(store: Store, spec: JobSpec) -> RowStats:
    """Latency, output length and finish reason of every stored row of the job."""
    stats = RowStats()
    for key in store.list(results_prefix(spec.name)):
        if batch_of_result_key(key) is not None:
            for row in decode_rows(store.get(key)):
                stats.add(row)
    return stats


def _percentiles(values: list[float] | list[int]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=float)
    out = {f"p{p}": round(float(np.percentile(arr, p)), 3) for p in PERCENTILES}
    return {**out, "mean": round(float(arr.mean()), 3), "max": round(float(arr.max()), 3)}


def _per_gpu(series: Series) -> list[dict[str, Any]]:
    out = []
    for node in sorted(series.node_tokens):
        tokens = series.node_tokens[node]
        busy_s = len(tokens) * jobstate.SERIES_BUCKET_S
        out.append({"node": node, "prompts": sum(series.node_rows.get(node, {}).values()),
                    "output_tokens": sum(tokens.values()),
                    "busy_tokens_per_sec": round(sum(tokens.values()) / max(busy_s, 1), 1)})
    return out


def summarize(status: dict[str, Any], series: Series, rows: RowStats) -> dict[str, Any]:
    """The numbers of the report (also written as summary.json)."""
    span = series.span_s(time.time())
    keep = ("job", "total", "completed", "failed", "quarantined", "truncated", "output_tokens",
            "done", "eta_hours", "rate_per_sec", "tokens_per_sec")
    return {
        **{k: status.get(k) for k in keep},
        "generation_s": round(span, 1),
        "mean_tokens_per_sec": round(status["output_tokens"] / span, 1) if span else None,
        "gpus": _per_gpu(series),
        "latency_s": _percentiles(rows.latency_s),
        "output_length_tokens": _percentiles(rows.output_tokens),
        "finish_reasons": dict(rows.finish.most_common()),
    }


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _dist_rows(summary: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for name, key in (("latency (s)", "latency_s"), ("output length (tokens)",
                                                      "output_length_tokens")):
        d = summary[key]
        rows.append([name, *(d.get(k, "-") for k in ("p50", "p90", "p99", "mean", "max"))])
    return rows


def markdown(summary: dict[str, Any]) -> str:
    """The report as Markdown, linking the PNGs next to it."""
    s = summary
    eta = "done" if s["done"] else (f"{s['eta_hours']:.2f} h" if s["eta_hours"] else "unknown")
    lines = [f"# Job {s['job']}", ""]
    lines += _table(["prompts", "completed", "failed (quarantined)", "truncated",
                     "output tokens", "generation", "mean tok/s", "ETA"],
                    [[f"{s['total']:,}", f"{s['completed']:,}",
                      f"{s['failed']:,} ({s['quarantined']:,})", f"{s['truncated']:,}",
                      f"{s['output_tokens']:,}", f"{s['generation_s'] / 60:.1f} min",
                      s["mean_tokens_per_sec"], eta]])
    lines += ["", "## Throughput per GPU", "", "![tokens/s per GPU](throughput.png)", ""]
    lines += _table(["node", "prompts", "output tokens", "tok/s while busy"],
                    [[g["node"], g["prompts"], f"{g['output_tokens']:,}",
                      g["busy_tokens_per_sec"]] for g in s["gpus"]])
    lines += ["", "## Progress", "", "![progress against the ETA](progress.png)", "",
              "## Latency and output length", ""]
    lines += _table(["", "p50", "p90", "p99", "mean", "max"], _dist_rows(s))
    lines += ["", "![latency](latency.png) ![output length](output_length.png)", "",
              "## Finish reasons", ""]
    lines += _table(["reason", "prompts"], [[k, v] for k, v in s["finish_reasons"].items()])
    lines += ["", "![finish reasons](finish_reasons.png)", ""]
    return "\n".join(lines)


def build_report(r: redis.Redis, store: Store, spec: JobSpec, out: Path) -> dict[str, Any]:
    """Write report.md, summary.json and the PNG plots into ``out``; return the summary."""
    out.mkdir(parents=True, exist_ok=True)
    status = job_status(r, spec)
    series = read_series(r, spec.name)
    rows = read_rows(store, spec)
    summary = summarize(status, series, rows)
    files = [
        plots.throughput(series.node_tokens, out / "throughput.png"),
        plots.progress(series.rows, status, out / "progress.png"),
        plots.histogram(rows.latency_s, "latency (s)", out / "latency.png"),
        plots.histogram(rows.output_tokens, "output length (tokens)", out / "output_length.png"),
        plots.bars(rows.finish, "finish reason", out / "finish_reasons.png"),
    ]
    (out / "report.md").write_text(markdown(summary))
    (out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return {**summary, "files": [str(p) for p in [out / "report.md", *files]]}
