"""``python -m producer report --job NAME --out DIR``: a Markdown summary with PNG plots.

What it reads, all recorded by the fleet during the run:

- the stored results: latency, output length, finish reason and the time (``finished_at``) of
  every prompt, so throughput per GPU and progress are drawn in buckets sized by the job's
  length (about 60 points, from 1 s for a demo to hours for a long job);
- for rows stored without a time, the job's 10-s time series in Redis
  (``fleet:job:{j}:series:n`` / ``:tok``, one field per bucket and GPU);
- the live counters, rates and ETA (:func:`producer.status.job_status`).

It writes ``report.md``, ``summary.json`` and the six PNGs of :data:`PLOTS` into DIR.
"""

from __future__ import annotations

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
from workers.dataset.manifest import load_manifest, row_bucket
from workers.dataset.store import Store
from workers.redisdb.keys import SERIES_BUCKET_S, JobKeys

PERCENTILES = (50, 90, 99)
# The plots the report writes (docs/observability.md names each).
PLOTS = ("throughput.png", "progress.png", "latency.png", "output_length.png",
         "finish_reasons.png", "quality.png")


@dataclass
class Timeline:
    """Prompts and output tokens over time, in buckets of ``width`` seconds counted from the
    first result (in total and per worker node)."""

    width: int
    span_s: float = 0.0
    rows: dict[int, int] = field(default_factory=dict)
    node_rows: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    node_tokens: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))

    def add(self, offset_s: float, node: str, rows: int, tokens: int) -> None:
        """Count ``rows`` prompts and ``tokens`` output tokens at ``offset_s``."""
        b = int(offset_s // self.width) * self.width
        self.rows[b] = self.rows.get(b, 0) + rows
        per_node = self.node_rows[node]
        per_node[b] = per_node.get(b, 0) + rows
        toks = self.node_tokens[node]
        toks[b] = toks.get(b, 0) + tokens


def timeline_from_rows(events: list[tuple[float, str, int]]) -> Timeline | None:
    """The timeline of stored rows' ``finished_at`` (None when no row has one): buckets sized
    by the job's length (producer/plots.py, ``bucket_width_s``)."""
    if not events:
        return None
    t0 = min(t for t, _, _ in events)
    span = max(max(t for t, _, _ in events) - t0, 1.0)
    line = Timeline(width=plots.bucket_width_s(span), span_s=span)
    for t, node, tokens in events:
        line.add(t - t0, node, 1, tokens)
    return line


def timeline_from_series(r: redis.Redis, job: str) -> Timeline:
    """The timeline of the job's 10-s series in Redis, for rows stored without
    ``finished_at`` (empty if Redis no longer has the series)."""
    keys = JobKeys(job)
    width = SERIES_BUCKET_S
    raw_n, raw_tok = r.hgetall(keys.series_n), r.hgetall(keys.series_tok)
    starts = [int(k.decode().partition("|")[0]) for k in raw_n]
    line = Timeline(width=width)
    if not starts:
        return line
    t0 = min(starts)
    line.span_s = float(max(starts) + width - t0)
    for key, value in raw_n.items():
        bucket, _, node = key.decode().partition("|")
        if node:
            tokens = int(raw_tok.get(key, 0))
            line.add(int(bucket) - t0, node, int(value), tokens)
    return line


@dataclass
class RowStats:
    """Per-prompt numbers from the stored results."""

    latency_s: list[float] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    finish: Counter[str] = field(default_factory=Counter)
    # (finished_at, node, output tokens) of each row that has its time.
    events: list[tuple[float, str, int]] = field(default_factory=list)

    def add(self, row: dict[str, Any]) -> None:
        """Count one stored row."""
        if row.get("finished_at") is not None:
            self.events.append((float(row["finished_at"]), str(row.get("node") or "?"),
                                int(row.get("completion_tokens") or 0)))
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
    """p50, p90, p99, mean and max; the max of token counts is the integer it is (the same
    figure as ``verify``'s completion-token max)."""
    if not values:
        return {}
    arr = np.asarray(values, dtype=float)
    out = {f"p{p}": round(float(np.percentile(arr, p)), 3) for p in PERCENTILES}
    top = max(values)
    return {**out, "mean": round(float(arr.mean()), 3),
            "max": top if isinstance(top, int) else round(float(top), 3)}


def _per_gpu(line: Timeline) -> list[dict[str, Any]]:
    out = []
    for node in sorted(line.node_tokens):
        tokens = line.node_tokens[node]
        busy_s = sum(1 for v in line.node_rows[node].values() if v) * line.width
        out.append({"node": node, "prompts": sum(line.node_rows[node].values()),
                    "output_tokens": sum(tokens.values()),
                    "busy_tokens_per_sec": round(sum(tokens.values()) / max(busy_s, 1), 1)})
    return out


def summarize(status: dict[str, Any], line: Timeline, rows: RowStats) -> dict[str, Any]:
    """The numbers of the report (also written as summary.json). The rates are the status's:
    over the job's active span once it is done (producer/status.py)."""
    keep = ("job", "state", "total", "prompts", "samples", "completed", "failed",
            "quarantined", "truncated",
            "output_tokens", "done", "eta_hours", "rate_per_sec", "tokens_per_sec",
            "elapsed_s", "active_s", "dataset")
    span = line.span_s
    return {
        **{k: status.get(k) for k in keep},
        "generation_s": round(span, 1),
        "mean_tokens_per_sec": round(status["output_tokens"] / span, 1) if span else None,
        "bucket_s": line.width,
        "gpus": _per_gpu(line),
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
        rows.append([name, *(_cell(d.get(k, "-")) for k in ("p50", "p90", "p99", "mean",
                                                            "max"))])
    return rows


def _cell(value: Any) -> str:
    """A number of the report's tables: integers (whole floats too) with thousands commas."""
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return f"{int(value):,}"
    return str(value)


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 180 else f"{seconds / 60:.1f} min"


def markdown(summary: dict[str, Any]) -> str:
    """The report as Markdown, linking the PNGs next to it."""
    s = summary
    eta = "done" if s["done"] else (f"{s['eta_hours']:.2f} h" if s["eta_hours"] else "unknown")
    lines = [f"# Job {s['job']}", ""]
    # With several samples per prompt the counts are samples (one row each).
    several = s.get("prompts") not in (None, s["total"])
    lines += _table([*(["prompts", "samples"] if several else ["prompts"]), "completed",
                     "failed (quarantined)", "truncated", "output tokens", "generation",
                     "mean tok/s", "ETA"],
                    [[*([f"{s['prompts']:,}"] if several else []), f"{s['total']:,}",
                      f"{s['completed']:,}",
                      f"{s['failed']:,} ({s['quarantined']:,})", f"{s['truncated']:,}",
                      f"{s['output_tokens']:,}", _duration(s["generation_s"]),
                      s["mean_tokens_per_sec"], eta]])
    q = s.get("quality")
    verdict = ("no data set committed yet" if q is None else
               "every gate passed" if not q["gates_failed"] else
               f"{len(q['gates_failed'])} gate(s) failed: {', '.join(q['gates_failed'])}")
    lines += ["", "## Quality", "", f"Quality of the committed data set: {verdict}.", "",
              "![quality](quality.png)", ""]
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
    rows = read_rows(store, spec)
    line = timeline_from_rows(rows.events) or timeline_from_series(r, spec.name)
    summary = summarize(status, line, rows)
    manifest = load_manifest(store, spec.name)
    quality = (manifest or {}).get("quality")
    summary["quality"] = None if quality is None else {
        "completion_tokens": quality["completion_tokens"], "gates_failed": quality["gates_failed"],
        "failed": quality["failed"]}
    paths = dict(zip(PLOTS, (out / name for name in PLOTS), strict=True))
    files = [
        plots.throughput(line.node_tokens, line.width, paths["throughput.png"]),
        plots.progress(line.rows, line.width, status, paths["progress.png"]),
        plots.histogram(rows.latency_s, "latency (s)", paths["latency.png"]),
        plots.histogram(rows.output_tokens, "output length (tokens)",
                        paths["output_length.png"]),
        plots.bars(rows.finish, "finish reason", paths["finish_reasons.png"]),
        plots.quality(quality, paths["quality.png"]),
    ]
    (out / "report.md").write_text(markdown(summary))
    (out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return {**summary, "files": [str(p) for p in [out / "report.md", *files]]}
