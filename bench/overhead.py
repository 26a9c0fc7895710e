"""Goal 4, worker overhead: one worker >= 2,000 requests/s; its own CPU <= 0.5 ms per request.

The engine is the simulator with no latency to speak of (FLEET_SIM_SPEED=1e6), so what is
measured is the worker: Celery, the batch runner, the HTTP client, the progress recording in
Redis and the result write. Payloads are real-sized (issue 14, finding 5): prompts of 1 KB and
thinking-mode outputs of about 3,000 tokens (the simulator writes 4 characters per token, 80 %
of them as ``reasoning_content``: ~9.6 KB of reasoning and ~2.4 KB of answer, log-normal sigma
0.1 around that). Requests/s is prompts over the time from the first batch taken to the last
batch done. CPU is read from /proc/<pid>/stat of the worker's main process and its pool
children (the engine guard and the engine are left out), and of redis-server, before and after
the job: Redis's own CPU per request is the cost the progress rows put on the broker. A
second, smaller run with cProfile in the pool children (:mod:`bench.profiled_worker`, CPU
clock) says where the time goes. ``--tiny`` runs the earlier measurement (outputs of a few
tokens, 80-byte prompts) instead.

    python -m bench.overhead [--prompts 10000] [--profile-prompts 1500] [--tiny]
"""

from __future__ import annotations

import argparse
import math
import pstats
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from bench.common import (
    ROOT,
    Fleet,
    Goal,
    MachineCpu,
    cpu_of,
    cpu_seconds,
    local_fleet,
    note,
    verdict,
    worker_pids,
    write_chat_prompts,
)
from bench.engines import JobWatch
from producer.localfleet import WorkerProcess, wait_healthy, worker_argv

RATE_GOAL = 2000.0
CPU_GOAL_MS = 0.5
PROMPT_BYTES = 1024
OUTPUT_TOKENS = 3000  # x 4 characters: ~12 KB of reasoning + answer
REAL = ({"FLEET_SIM_SPEED": "1000000", "FLEET_SIM_MEAN_OUTPUT_TOKENS": str(OUTPUT_TOKENS),
         "FLEET_SIM_OUTPUT_SIGMA": "0.1"}, 2 * OUTPUT_TOKENS, PROMPT_BYTES)
TINY = ({"FLEET_SIM_SPEED": "1000000", "FLEET_SIM_MEAN_OUTPUT_TOKENS": "2"}, 4, 0)
SIM_ENV, MAX_NEW_TOKENS, PAD_BYTES = REAL


def timed_job(fleet: Fleet, worker: WorkerProcess, prompts: Path, n: int, job: str
              ) -> tuple[float, float, float, float]:
    """(requests/s, worker CPU ms per request, Redis CPU ms per request, machine CPU busy)."""
    own, engine = worker_pids(worker.proc.pid)
    url = fleet.engine_url(worker.gpu)
    batch_size = 500
    machine = MachineCpu()
    cpu_main, cpu_own, cpu_engine = cpu_of(own[:1]), cpu_of(own), cpu_of(engine)
    redis_pid = fleet.redis_server.proc.pid
    cpu_redis = cpu_seconds(redis_pid)
    with JobWatch([url], [1], fleet.r, job, math.ceil(n / batch_size), interval_s=0.1) as watch:
        fleet.producer("enqueue", str(prompts), "--job", job, "--batch-size", str(batch_size),
                       "--max-new-tokens", str(MAX_NEW_TOKENS))
        tl = watch.wait(600)
    own_ms = (cpu_of(own) - cpu_own) * 1000 / n
    main_ms = (cpu_of(own[:1]) - cpu_main) * 1000 / n
    engine_ms = (cpu_of(engine) - cpu_engine) * 1000 / n
    redis_ms = (cpu_seconds(redis_pid) - cpu_redis) * 1000 / n
    rate = n / max((tl.t_done or 0) - (tl.t_started or 0), 1e-9)
    busy = machine.busy()
    note(f"{job}: {n} requests at {rate:,.0f}/s; worker CPU {own_ms:.3f} ms/request (main "
         f"process {main_ms:.3f}, {len(own) - 1} pool children {own_ms - main_ms:.3f}); Redis "
         f"CPU {redis_ms:.3f} ms/request; engine CPU {engine_ms:.3f} ms/request; machine CPU "
         f"{busy:.0%}")
    return rate, own_ms, redis_ms, busy


def start_profiled_worker(fleet: Fleet, profile_dir: Path) -> WorkerProcess:
    """One GPU-0 worker whose pool children run under cProfile."""
    node = "gpu0@bench-profiled"
    env = fleet.env(BENCH_PROFILE_DIR=str(profile_dir), **SIM_ENV)
    log_path = fleet.workdir / "logs" / "worker-profiled.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "bench.profiled_worker", *worker_argv(0, node)[3:]]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log_path.open("ab"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    worker = WorkerProcess(gpu=0, node=node, proc=proc, log_path=log_path, env=env)
    fleet.workers.append(worker)
    wait_healthy(fleet.r, [worker], timeout_s=180)
    return worker


# Entry points whose cumulative CPU time names a layer of the batch task (file suffix, function).
LAYERS = (
    ("HTTP client: aiohttp ClientSession._request (pool, parser, streams)",
     "aiohttp/client.py", "_request"),
    ("engine client, the line above included (EngineClient.complete: bodies, JSON, parsing)",
     "workers/engine/client.py", "complete"),
    ("concurrency limiter (workers/batch/limiter.py, Limiter.__aenter__)",
     "workers/batch/limiter.py", "__aenter__"),
    ("response JSON parse (orjson.loads)", "~", "<built-in method orjson.loads>"),
    ("progress to Redis (ProgressRecorder.flush, one Lua call per 0.5 s)",
     "workers/delivery/progress.py", "flush"),
    ("result rows (result_row)", "workers/delivery/progress.py", "result_row"),
    ("results to the store (workers/batch/results.py, finish)",
     "workers/batch/results.py", "finish"),
    ("batch input from the store (load_batch_input)", "workers/dataset/jobs.py",
     "load_batch_input"),
)


def category(path: str) -> str:
    """Where a profiled function lives: a package, a project module or the interpreter."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
    if str(ROOT) in path:
        return path.removeprefix(str(ROOT) + "/")
    if path == "~":
        return "builtins (C)"
    return "stdlib " + Path(path).name.removesuffix(".py")


def _layer_times(stats: pstats.Stats) -> list[tuple[str, float]]:
    """Cumulative seconds of each LAYERS entry point (summed over matching functions)."""
    table = stats.stats  # type: ignore[attr-defined]
    out = []
    for label, suffix, name in LAYERS:
        cum = sum(ct for (path, _line, fn), (_cc, _nc, _tt, ct, _callers) in table.items()
                  if path.endswith(suffix) and fn == name)
        out.append((label, cum))
    return out


def where_time_goes(profile_dir: Path, requests: int, top: int = 10) -> None:
    """Print the pool children's CPU by layer, by package and by function."""
    files = [str(p) for p in profile_dir.glob("child-*.prof")]
    if not files:
        note("no profile written")
        return
    stats = pstats.Stats(*files)
    by_cat: dict[str, float] = defaultdict(float)
    rows = []
    for (path, line, name), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        by_cat[category(path)] += tt
        rows.append((tt, f"{category(path)}:{line}({name})"))
    total = sum(by_cat.values())
    print(f"\n  where a pool child's CPU goes (cProfile on the CPU clock, {requests} requests; "
          f"{total * 1000 / requests:.3f} ms/request with the profiler's own cost):")
    for label, cum in _layer_times(stats):
        print(f"    {cum / total:6.1%}  {label}")
    print("  by package (own time):")
    for cat, tt in sorted(by_cat.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {tt / total:6.1%}  {cat}")
    print("  top functions (own time):")
    for tt, name in sorted(rows, reverse=True)[:top]:
        print(f"    {tt / total:6.1%}  {name}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 when a goal is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompts", type=int, default=10000)
    parser.add_argument("--profile-prompts", type=int, default=1500)
    parser.add_argument("--tiny", action="store_true",
                        help="outputs of a few tokens and short prompts (the earlier figure)")
    args = parser.parse_args(argv)
    global SIM_ENV, MAX_NEW_TOKENS, PAD_BYTES
    SIM_ENV, MAX_NEW_TOKENS, PAD_BYTES = TINY if args.tiny else REAL
    payload = "tiny payloads" if args.tiny else "1 KB prompts, ~12 KB outputs"
    with local_fleet("overhead", **SIM_ENV) as fleet:
        prompts = write_chat_prompts(fleet.workdir / "prompts.jsonl", args.prompts, PAD_BYTES)
        [worker] = fleet.start_workers(1)
        time.sleep(1.0)  # let start-up work settle before the clocks are read
        rate, own_ms, redis_ms, _busy = timed_job(fleet, worker, prompts, args.prompts, "ovh")
        fleet.stop_workers()
        if args.profile_prompts:
            profile_dir = fleet.workdir / "profile"
            profile_dir.mkdir()
            small = write_chat_prompts(fleet.workdir / "small.jsonl", args.profile_prompts,
                                       PAD_BYTES)
            worker = start_profiled_worker(fleet, profile_dir)
            timed_job(fleet, worker, small, args.profile_prompts, "ovh-profiled")
            fleet.stop_workers()
            where_time_goes(profile_dir, args.profile_prompts)
    return verdict(f"bench.overhead (goal 4; {payload})", [
        Goal("requests/s, one worker", rate, RATE_GOAL, "req/s"),
        Goal("worker CPU per request", own_ms, CPU_GOAL_MS, "ms", at_most=True),
        Goal("  worker + Redis CPU per request (Redis alone: "
             f"{redis_ms:.3f} ms)", own_ms + redis_ms, CPU_GOAL_MS, "ms", at_most=True),
    ])


if __name__ == "__main__":
    sys.exit(main())
