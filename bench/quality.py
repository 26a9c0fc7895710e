"""What measuring quality costs the sink: the same 100k-row job aggregated with the quality
tally and without it, interleaved, in one run.

    python -m bench.quality [--rows 100000]

Rows are as workers write them, sized as the workload's (docs/workload.md: ~2,490 output
tokens on average, long-tailed; a thinking job, 80 % of each output reasoning), every 20th
near-empty, a few failed; the store is a local folder. The goal's figure is the
CPU time the measurement's calls take (``time.thread_time`` around each call) over the sink
run's wall time, median of five runs. The wall-clock time inside the calls is printed beside
it: it also holds the time the sink's thread waits there for the GIL while its read-ahead
threads decode the next batches, work the sink does with or without the measurement (the
sink's process runs about one core busy: whoever holds the GIL is the sink's critical path,
so the measurement's added wall time is the time it holds the GIL, at most its CPU time).
The sink's time with ÷ without it (the median of five interleaved pairs) is printed too; on
a shared machine its pairs scatter by ±10 %. Goal ≤ 5 %.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Goal, note, verdict
from producer.enqueue import EnqueueReport, stage
from workers.dataset import sink
from workers.dataset.jobs import JobSpec, SamplingSpec, encode_rows, result_key, save_spec
from workers.dataset.manifest import load_manifest
from workers.dataset.sink import ShardLimits, aggregate
from workers.dataset.store import LocalStore

BATCH = 1000
RUNS = 5
WORDS = "the model said that every row of the data set holds a useful answer for training".split()
_CORPUS = " ".join(random.Random(3).choice(WORDS) for _ in range(4000))


def _text(rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of words (a shuffled slice of a long text, quickly)."""
    start = rng.randrange(len(_CORPUS) - 100)
    reps = chars // (len(_CORPUS) - start) + 1
    return ((_CORPUS[start:] + " ") * reps)[:chars]


def build(root: Path, rows: int) -> LocalStore:
    """A job of ``rows`` prompts with every batch's results stored."""
    store, rng = LocalStore(root), random.Random(7)
    staged = [{"index": i, "id": f"r{i}", "prompt": f"question {i}"} for i in range(rows)]
    report = EnqueueReport(spec=None, created=True)  # type: ignore[arg-type]
    total, n, fp = stage(store, "qb", staged, BATCH, report, False)
    spec = JobSpec(name="qb", total=total, batch_size=BATCH, n_batches=n, input_path="x",
                   input_fingerprint=fp, sampling=SamplingSpec(chat=True),
                   input_sha256=report.batch_sha256, created_at=1.7e9)
    save_spec(store, spec)
    for b in range(n):
        got = []
        for i in spec.batch_range(b):
            failed = i % 97 == 5
            # The workload's outputs: ~2,490 tokens on average (about 10k characters),
            # long-tailed; in thinking mode 80 % of them reasoning.
            chars = min(int(rng.lognormvariate(8.9, 0.8)), 80_000)
            think = i % 50 != 7  # a thinking job; a few rows without reasoning
            answer = 4 if i % 20 == 0 else (chars // 5 if think else chars)
            got.append({
                "job": "qb", "batch": b, "index": i, "id": f"r{i}", "prompt": f"question {i}",
                "completion": None if failed else f"{i} " + _text(rng, answer),
                "reasoning": _text(rng, chars - chars // 5) if think and not failed else None,
                "finish_reason": None if failed else "stop", "status":
                "failed" if failed else "ok", "error": "engine" if failed else None,
                "prompt_tokens": 5, "completion_tokens": 0 if failed else chars // 4,
                "latency_s": 1.0, "profile": "qwen36-27b", "gpu": 0, "node": "n",
            })
        store.put(result_key("qb", b), encode_rows(got, compress=False))
    return store


def _timed(store: LocalStore) -> float:
    t0 = time.perf_counter()
    aggregate(store, "qb", ShardLimits())
    return time.perf_counter() - t0


def on_quality(store: LocalStore) -> bool:
    """Whether the last committed manifest measured the rows (so the run measured something:
    every 20th row near-empty, 2 % without reasoning)."""
    figures = (load_manifest(store, "qb") or {}).get("quality", {}).get("figures", {})
    return figures.get("near_empty", {}).get("count", 0) > 0


def main(argv: list[str] | None = None) -> int:
    """Build the job, time the sink with and without quality, print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args(argv)
    measure = sink.add_table  # what the sink calls on every row group it writes
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        note(f"building a job of {args.rows:,} rows")
        store = build(Path(tmp) / "store", args.rows)
        on, off, inside, cpu = [], [], [], []
        spent = [0.0, 0.0]  # wall, CPU of this thread inside the measurement

        def timed_measure(tally: object, table: object) -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            measure(tally, table)
            spent[0] += time.perf_counter() - t0
            spent[1] += time.thread_time() - c0

        for _ in range(RUNS):
            sink.add_table = lambda tally, table: None
            off.append(_timed(store))
            sink.add_table = timed_measure  # the last run measures: its manifest is checked
            spent[:] = [0.0, 0.0]
            on.append(_timed(store))
            inside.append(spent[0] / on[-1])
            cpu.append(spent[1] / on[-1])
        quality_ok = on_quality(store)
    pairs = sorted(a / b for a, b in zip(on, off, strict=True))
    note(f"sink with quality {min(on):.2f} s, without {min(off):.2f} s (best of {RUNS}); "
         f"with ÷ without, median of the {RUNS} interleaved pairs: {pairs[RUNS // 2]:.3f} "
         f"(pairs {pairs[0]:.3f}-{pairs[-1]:.3f}: this machine's noise); the manifest "
         f"{'holds' if quality_ok else 'LACKS'} the figures")
    # The goal's figure: the CPU the measurement takes over each measuring run's wall time,
    # the median of the runs (module docstring); the wall-clock difference above is noise.
    cost = sorted(cpu)[len(cpu) // 2]
    note(f"wall time inside the measurement per run (GIL waits included): "
         f"{', '.join(f'{x:.3f}' for x in inside)}")
    note(f"CPU time inside the measurement per run: {', '.join(f'{x:.3f}' for x in cpu)}")
    return verdict(f"quality measurement in the sink, {args.rows:,} rows", [
        Goal("share of the sink's time spent measuring quality (CPU inside the calls)",
             cost if quality_ok else 1.0, 0.05, at_most=True)])


if __name__ == "__main__":
    sys.exit(main())
