"""Goal 5, scaling: with 1, 2, 4 and 7 simulated GPUs the throughput stays >= 0.95 x ideal.

Weak scaling: every size gets the same work per GPU (``--per-gpu`` prompts in batches of
``--batch-size``, so each GPU sees the same number of batch rounds) with the workload's output
lengths. The simulator's speed is set per size so that the whole fleet asks for the same number
of requests per second (``--requests-per-s``): the machine's two cores carry the same load at
every size and are not what limits it. Throughput is the engines' decode tokens/s from the
first request until the last batch has been taken from the queue (the same window as the
occupancy of goal 1; what follows is the job's drain, whose length depends on the job's size,
not on the fleet's); the job is then cancelled.

    python -m bench.scaling [--sizes 1 2 4 7] [--per-gpu 800] [--batch-size 200]
                            [--requests-per-s 45]
"""

from __future__ import annotations

import argparse
import sys

from bench.common import (
    PROFILE,
    WORKLOAD_MAX_NEW_TOKENS,
    WORKLOAD_MEAN_TOKENS,
    Goal,
    capped_mean_tokens,
    local_fleet,
    note,
    verdict,
    write_chat_prompts,
)
from bench.engines import planned_engine_model
from bench.jobrun import JobResult, run_job

RATIO_GOAL = 0.95


def speed_for(gpus: int, requests_per_s: float) -> float:
    """FLEET_SIM_SPEED at which ``gpus`` engines at their cap finish ``requests_per_s``."""
    per_engine = planned_engine_model(PROFILE, 1.0).ideal_tokens_per_s / capped_mean_tokens()
    return requests_per_s / (gpus * per_engine)


def measure(gpus: int, per_gpu: int, batch_size: int, requests_per_s: float) -> JobResult:
    """One fleet of ``gpus`` workers, one job of ``per_gpu`` prompts per GPU."""
    speed = speed_for(gpus, requests_per_s)
    prompts = per_gpu * gpus
    with local_fleet(f"scaling{gpus}", FLEET_SIM_SPEED=f"{speed:.4f}",
                     FLEET_SIM_MEAN_OUTPUT_TOKENS=str(WORKLOAD_MEAN_TOKENS)) as fleet:
        path = write_chat_prompts(fleet.workdir / "prompts.jsonl", prompts)
        fleet.start_workers(gpus)
        note(f"{gpus} workers up, engine speed x{speed:.2f}")
        return run_job(fleet, gpus, path, prompts, f"scale{gpus}", batch_size,
                       WORKLOAD_MAX_NEW_TOKENS, speed, stop_when_all_taken=True)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 when a goal is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 7])
    parser.add_argument("--per-gpu", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=200)
    parser.add_argument("--requests-per-s", type=float, default=45.0)
    args = parser.parse_args(argv)
    results = [measure(n, args.per_gpu, args.batch_size, args.requests_per_s) for n in args.sizes]
    return verdict("bench.scaling (goal 5)", [
        Goal(f"{r.gpus} GPU(s): tokens/s / ideal (occupancy {r.timeline.occupancy():.3f})",
             r.steady_ratio, RATIO_GOAL) for r in results
    ])


if __name__ == "__main__":
    sys.exit(main())
