"""The early quality warning of a running job: a live tally of its rows in Redis.

Each batch run folds the rows it answers into a :class:`LiveFold` (the per-row figures of
:mod:`workers.dataset.quality`, ``quality_gates.PER_ROW``: near-empty, invalid form, missing
reasoning, leftover markers, truncated, failed, quarantined) and adds it to the job's hash
(``Keys.quality``) with each progress flush (workers/delivery/progress.py), a few seconds after
the rows are answered. Once the tally holds ``FLEET_QUALITY_EARLY_ROWS`` rows (200 by default),
a gate it breaks is a warning: ``status`` shows it, Prometheus has
``fleet_job_quality_gate_failing`` and the worker that sees it first logs one line per gate.
Figures across rows (identical answers, all-equal samples) are the sink's only. The tally is a
warning, not the verdict: a redelivered batch may count a row twice; the sink's figures over
the data set decide.

A job enqueued with ``--on-quality-warning pause`` is paused by the worker that first sees a
gate fail (once per gate: a job resumed by hand is not paused again for the same gate), as
``fleet pause`` would: queued batches are dropped when taken, running ones finish, so no
more than one batch per GPU runs after the warning; ``fleet resume`` sends the rest.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
import redis.asyncio as aioredis

from workers.dataset.jobs import JobSpec
from workers.dataset.quality import QualityTally
from workers.dataset.quality_gates import (
    COUNTERS,
    EXAMPLES,
    FIGURES,
    PER_ROW,
    evaluate,
    gate_line,
    shares,
    thresholds,
)
from workers.dataset.quality_options import job_options
from workers.redisdb import scripts
from workers.redisdb.keys import JobKeys

log = logging.getLogger(__name__)

# The live figures: those a row decides, and the ones that add them up.
LIVE = tuple(n for n, f in FIGURES.items() if f.per_row)


class LiveFold:
    """The per-row figures of the rows answered since the last :meth:`drain`; ``rows``: the
    batch's staged rows (their own request parameters, e.g. a structured output)."""

    def __init__(self, spec: JobSpec, rows: list[dict[str, Any]] | None = None) -> None:
        limits = thresholds(spec.quality)
        self._options = job_options(spec, int(limits["near_empty_tokens"]))
        self._options.add_rows(rows)
        self._tally = self._new()

    def _new(self) -> QualityTally:
        return QualityTally(self._options)

    def add(self, row: dict[str, Any]) -> None:
        """Fold one answered (or failed) row."""
        self._tally.add(row)

    def drain(self) -> QualityTally | None:
        """The tally so far (None when empty), and start a new one."""
        tally, self._tally = self._tally, self._new()
        return tally if tally.rows else None


async def push(r: aioredis.Redis, spec: JobSpec, tally: QualityTally, early_rows: int) -> None:
    """Add ``tally`` to the job's live hash; log each gate the first time it fails, and
    pause a job enqueued with ``--on-quality-warning pause`` (see the module docstring)."""
    keys = JobKeys(spec.name)
    key = keys.quality
    counts = tally.counters()
    async with r.pipeline(transaction=False) as pipe:
        for name in COUNTERS:
            if name != "prompts_sampled":
                pipe.hincrby(key, name, counts[name])
        for name in PER_ROW:
            fig = tally.figures[name]
            if fig.count:
                pipe.hincrby(key, name, fig.count)
                pipe.rpush(keys.quality_examples(name), *fig.examples)
                pipe.ltrim(keys.quality_examples(name), 0, EXAMPLES - 1)
        await pipe.execute()
    live = _live(await r.hgetall(key), {}, spec, early_rows)
    for gate in live["failed"]:
        if await r.hsetnx(key, f"warned:{gate['gate']}", 1):
            line = gate_line(gate)
            log.warning("quality warning: job %s, first %d rows: %s", spec.name, live["rows"],
                        line)
            if spec.on_quality_warning == "pause" and await scripts.pause_if_running(
                    r, spec.name, f"quality warning: {line}"):
                log.warning("job %s paused on its quality warning (fleet resume --job %s "
                            "goes on)", spec.name, spec.name)


def _live(raw: dict[bytes, bytes], examples: dict[str, list[str]], spec: JobSpec,
          early_rows: int) -> dict[str, Any]:
    counts = {k.decode(): int(v) for k, v in raw.items() if not k.startswith(b"warned:")}
    rows = counts.get("rows", 0)
    figures = shares(counts, examples, LIVE)
    failed = evaluate({"figures": figures}, thresholds(spec.quality)) if rows >= early_rows else []
    return {"rows": rows, "early_rows": early_rows, "figures": figures, "failed": failed,
            "warning": "; ".join(gate_line(g) for g in failed) or None}


def read_live(r: redis.Redis, spec: JobSpec, early_rows: int) -> dict[str, Any]:
    """The job's live tally: its figures, and the gates it breaks once it holds
    ``early_rows`` rows (``warning``: them in words, None while none fails)."""
    keys = JobKeys(spec.name)
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.quality)
    for name in PER_ROW:
        pipe.lrange(keys.quality_examples(name), 0, EXAMPLES - 1)
    raw, *ex = pipe.execute()
    examples = {name: [x.decode() for x in got] for name, got in zip(PER_ROW, ex, strict=True)}
    return _live(raw, examples, spec, early_rows)
