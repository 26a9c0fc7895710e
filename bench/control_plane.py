"""Goal 3, the control plane at 1M prompts: enqueue <= 60 s, Redis <= 50 MB, status <= 200 ms.

Generates 1,000,000 chat prompts of 1 KB (varied text, so staging compresses like real data)
under a temp folder, times ``python -m producer enqueue`` into a local store folder (default
batch size), reads Redis ``used_memory`` with the whole job queued, then starts one worker on a
fast simulator so the job is really running and times ``python -m producer status --json``
several times mid-job (the CLI as a user runs it, process start included; the in-process
``job_status`` call is printed beside it). The folder (~1 GB input, ~0.5 GB staged) is deleted.

    python -m bench.control_plane [--prompts 1000000]
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import ROOT, Fleet, Goal, local_fleet, note, verdict, write_chat_prompts
from producer.enqueue import EnqueueReport, stage
from producer.readers import read_rows
from producer.status import job_status
from workers.dataset.jobs import JobSpec, load_spec
from workers.dataset.store import open_store

ENQUEUE_GOAL_S = 60.0
REDIS_GOAL_MB = 50.0
STATUS_GOAL_MS = 200.0
PROMPT_BYTES = 1024
STATUS_CALLS = 7
PROFILE_ROWS = 50_000
# The heaviest imports of ``status --json`` (they share standard-library modules, so their
# times alone add up to more than importing producer.cli).
CLI_IMPORTS = (("redis-py", "redis"), ("config.settings (pydantic-settings)", "config.settings"),
               ("typer", "typer"))
# (label, file suffix, function): cumulative time of these calls splits staging into its parts,
# on the main thread (parse, fingerprint, encode) and on the writer thread (gzip, store writes).
MAIN_PARTS = (
    ("read + parse the JSONL (orjson, normalize)", "producer/readers.py", "read_jsonl"),
    ("fingerprint (orjson sort_keys + sha256)", "producer/enqueue.py", "_fingerprint"),
    ("encode each batch as JSONL (orjson)", "workers/dataset/jobs.py", "encode_rows"),
    ("wait for the writer thread (queue full, last writes)", "~",
     "<method 'acquire' of '_thread.lock' objects>"),
)
WRITER_PARTS = (
    ("gzip level 1 (zlib.compress)", "~", "<built-in method zlib.compress>"),
    ("store writes (write, fsync, rename)", "workers/dataset/store.py", "put_stream"),
)


def time_cli(fleet: Fleet, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Wall seconds of one ``python -m producer`` call, and its result."""
    t0 = time.monotonic()
    res = fleet.producer(*args)
    return time.monotonic() - t0, res


def status_latencies(fleet: Fleet, job: str) -> tuple[list[float], list[float]]:
    """(CLI wall ms, in-process job_status ms) of STATUS_CALLS calls while the job runs."""
    spec = load_spec(open_store(fleet.base_env["FLEET_STORE_URL"]), job)
    cli_ms, call_ms = [], []
    for _ in range(STATUS_CALLS):
        secs, _res = time_cli(fleet, "status", "--job", job, "--json")
        cli_ms.append(secs * 1000)
        t0 = time.monotonic()
        job_status(fleet.r, spec)
        call_ms.append((time.monotonic() - t0) * 1000)
    return cli_ms, call_ms


def interpreter_ms(imports: str, runs: int = 7) -> float:
    """Median wall ms of an interpreter that imports ``imports`` (comma-separated modules, or
    none) and stops at once: start-up plus the imports, without the exit's module teardown."""
    statement = f"import os{', ' + imports if imports else ''}; os._exit(0)"
    times = []
    for _ in range(runs):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", statement], cwd=ROOT, check=True)
        times.append((time.monotonic() - t0) * 1000)
    return statistics.median(times)


@contextmanager
def profile_new_threads(profilers: list[cProfile.Profile]) -> Iterator[None]:
    """Run each thread started inside the block under a cProfile profiler of its own."""
    def start(*_args: object) -> None:
        sys.setprofile(None)
        profiler = cProfile.Profile()
        profilers.append(profiler)
        profiler.enable()

    threading.setprofile(start)
    try:
        yield
    finally:
        threading.setprofile(None)


def print_parts(profiler: cProfile.Profile, parts: tuple[tuple[str, str, str], ...],
                wall: float, scale: float) -> None:
    """Print the cumulative time of each part of a profile, as a share of ``wall``."""
    table = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    for label, suffix, name in parts:
        cum = sum(ct for (file, _line, fn), (_cc, _nc, _tt, ct, _callers) in table.items()
                  if file.endswith(suffix) and fn == name)
        print(f"    {cum / wall:6.1%}  {label}  (~{cum * scale:.0f} s per 1M rows)")


def stage_breakdown(path: Path, workdir: Path, rows: int = PROFILE_ROWS) -> None:
    """Profile staging of the first ``rows`` prompts in-process; print its parts for 1M rows."""
    store = open_store((workdir / "profile-store").as_uri())
    spec = JobSpec(name="prof", total=0, batch_size=500, n_batches=0, input_path=str(path),
                   input_fingerprint="")
    profiler, writers = cProfile.Profile(), []
    t0 = time.monotonic()
    with profile_new_threads(writers):
        profiler.enable()
        stage(store, "prof", itertools.islice(read_rows(path), rows), 500,
              EnqueueReport(spec=spec, created=True), skip_existing=False)
        profiler.disable()
    wall = time.monotonic() - t0
    scale = 1_000_000 / rows
    print(f"  staging {rows:,} rows took {wall:.1f} s under cProfile "
          f"({wall * scale:.0f} s per 1M); of that, on the main thread:")
    print_parts(profiler, MAIN_PARTS, wall, scale)
    print("  and on the writer thread, at the same time:")
    for writer in writers:
        print_parts(writer, WRITER_PARTS, wall, scale)


def wait_running(fleet: Fleet, job: str, timeout_s: float = 120) -> dict:
    """Wait until ``job`` has batches running and prompts completed; return its status."""
    spec = load_spec(open_store(fleet.base_env["FLEET_STORE_URL"]), job)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = job_status(fleet.r, spec)
        if st["completed"] and st["in_flight_batches"]:
            return st
        time.sleep(0.5)
    raise TimeoutError(f"no prompt of {job} completed after {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 when a goal is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompts", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    job = "cp1m"
    # Mid-job means batches really run while status is asked: one engine with short outputs,
    # paced to ~40 requests/s (the load the other benchmarks put on this machine).
    with local_fleet("control-plane", FLEET_SIM_SPEED="0.6",
                     FLEET_SIM_MEAN_OUTPUT_TOKENS="50") as fleet:
        t0 = time.monotonic()
        path = write_chat_prompts(fleet.workdir / "prompts.jsonl", args.prompts, PROMPT_BYTES)
        note(f"wrote {args.prompts:,} prompts ({path.stat().st_size / 2**20:,.0f} MiB) in "
             f"{time.monotonic() - t0:.1f} s")
        base_mb = fleet.r.info("memory")["used_memory"] / 2**20
        enqueue_s, res = time_cli(fleet, "enqueue", str(path), "--job", job,
                                  "--max-new-tokens", "64")
        note(f"enqueue: {enqueue_s:.1f} s; {res.stderr.strip().splitlines()[-1]}")
        queued_mb = fleet.r.info("memory")["used_memory"] / 2**20
        note(f"Redis used_memory: {base_mb:.1f} MiB empty, {queued_mb:.1f} MiB with the job queued "
             f"({fleet.r.llen('gpu'):,} messages in queue 'gpu')")
        fleet.start_workers(1)
        st = wait_running(fleet, job)
        cli_ms, call_ms = status_latencies(fleet, job)
        note(f"status mid-job ({st['in_flight_batches']} batches running, {st['completed']:,} "
             f"prompts done): CLI "
             f"{', '.join(f'{m:.0f}' for m in cli_ms)} ms; in-process job_status "
             f"{', '.join(f'{m:.1f}' for m in call_ms)} ms")
        fleet.producer("cancel", "--job", job)
        start_ms = interpreter_ms("")
        import_ms = interpreter_ms("producer.cli")
        alone = {name: interpreter_ms(module) - start_ms for name, module in CLI_IMPORTS}
        reads_ms = statistics.median(call_ms)
        rest_ms = statistics.median(cli_ms) - import_ms - reads_ms
        note(f"of the CLI's time: interpreter start {start_ms:.0f} ms, importing producer.cli "
             f"{import_ms - start_ms:.0f} ms (each alone: "
             f"{', '.join(f'{name} {ms:.0f} ms' for name, ms in alone.items())}), "
             f"the Redis reads ~{reads_ms:.0f} ms, the rest (command line, settings, job "
             f"record, connect, exit) ~{rest_ms:.0f} ms")
        if enqueue_s > ENQUEUE_GOAL_S:
            stage_breakdown(path, fleet.workdir)
    return verdict("bench.control_plane (goal 3)", [
        Goal(f"enqueue of {args.prompts:,} prompts", enqueue_s, ENQUEUE_GOAL_S, "s",
             at_most=True),
        Goal("Redis used_memory, job queued", queued_mb, REDIS_GOAL_MB, "MiB", at_most=True),
        Goal("status --json mid-job, median", statistics.median(cli_ms), STATUS_GOAL_MS, "ms",
             at_most=True),
    ])


if __name__ == "__main__":
    sys.exit(main())
