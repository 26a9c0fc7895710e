"""Goal 2, against the plain script: the fleet's tokens/s >= 0.98 x the plain asyncio client's.

One fleet of simulated GPUs runs the job (queue, leases, durable progress, results in the store);
then :mod:`bench.plain_client` sends the same prompts straight to the same engines (the workers
sit idle) with 48 and then 96 requests in flight per server, as the original run did. Tokens/s
is output tokens from the first request to the last result, for both.

    python -m bench.vs_plain [--prompts 4000] [--gpus 2] [--speed 20]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench.common import (
    WORKLOAD_MAX_NEW_TOKENS,
    WORKLOAD_MEAN_TOKENS,
    Goal,
    MachineCpu,
    local_fleet,
    note,
    verdict,
    write_chat_prompts,
)
from bench.jobrun import JobResult, run_job
from bench.plain_client import PlainResult, read_prompts, run_plain

RATIO_GOAL = 0.98
PLAIN_IN_FLIGHT = (48, 96)


def measure(prompts: int, gpus: int, speed: float, batch_size: int
            ) -> tuple[JobResult, list[PlainResult]]:
    """The fleet's run, then one plain run per in-flight count, on the same engines."""
    with local_fleet("vs-plain", FLEET_SIM_SPEED=str(speed),
                     FLEET_SIM_MEAN_OUTPUT_TOKENS=str(WORKLOAD_MEAN_TOKENS)) as fleet:
        path = write_chat_prompts(fleet.workdir / "prompts.jsonl", prompts)
        fleet.start_workers(gpus)
        fleet_run = run_job(fleet, gpus, path, prompts, "vs-plain", batch_size,
                            WORKLOAD_MAX_NEW_TOKENS, speed)
        rows = read_prompts(path)
        urls = [fleet.engine_url(g) for g in range(gpus)]
        plain = []
        for in_flight in PLAIN_IN_FLIGHT:
            cpu, before = MachineCpu(), fleet.cpu_seconds()
            res = asyncio.run(run_plain(urls, rows, in_flight, WORKLOAD_MAX_NEW_TOKENS))
            cores = {k: (v - before[k]) / res.seconds for k, v in fleet.cpu_seconds().items()}
            note(f"plain client, {in_flight} in flight per server: {res.completed} done, "
                 f"{res.failed} failed, {res.seconds:.1f} s, {res.tokens_per_s:,.0f} tok/s "
                 f"= {res.tokens_per_s / fleet_run.ideal_tokens_per_s:.3f} x ideal; "
                 f"machine CPU {cpu.busy():.0%} (client {res.cpu_seconds / res.seconds:.2f} "
                 f"cores, engines {cores['engines']:.2f})")
            plain.append(res)
    return fleet_run, plain


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 when a goal is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompts", type=int, default=4000)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--speed", type=float, default=20.0)
    parser.add_argument("--batch-size", type=int, default=500)
    args = parser.parse_args(argv)
    fleet_run, plain = measure(args.prompts, args.gpus, args.speed, args.batch_size)
    goals = [Goal(f"fleet / plain ({p.in_flight} in flight per server)",
                  fleet_run.tokens_per_s / p.tokens_per_s, RATIO_GOAL) for p in plain]
    return verdict("bench.vs_plain (goal 2)", goals)


if __name__ == "__main__":
    sys.exit(main())
