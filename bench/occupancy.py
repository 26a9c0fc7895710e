"""Goal 1, engine occupancy: busy running slots >= 0.97 and tokens/s >= 0.95 x the ideal bound.

The same job runs twice on the same fleet size: *before* with one batch per GPU at a time
(``FLEET_BATCHES_PER_GPU=1``: a worker waits for its batch's slowest prompt before it takes the
next) and *after* with the default two (the next batch fills the slots during a batch's tail).
Output lengths are the workload's (log-normal, mean 2,490 tokens, capped by max_new_tokens
7,000); time is scaled by FLEET_SIM_SPEED so the run fits in minutes.

    python -m bench.occupancy [--prompts 4000] [--gpus 2] [--speed 18]
"""

from __future__ import annotations

import argparse
import sys

from bench.common import (
    WORKLOAD_MAX_NEW_TOKENS,
    WORKLOAD_MEAN_TOKENS,
    Goal,
    local_fleet,
    note,
    verdict,
    write_chat_prompts,
)
from bench.jobrun import JobResult, run_job

OCCUPANCY_GOAL = 0.97
IDEAL_RATIO_GOAL = 0.95


def measure(prompts: int, gpus: int, speed: float, batch_size: int) -> dict[int, JobResult]:
    """Run the job with 1 and then 2 batches per GPU; results by batches per GPU."""
    results: dict[int, JobResult] = {}
    with local_fleet("occupancy", FLEET_SIM_SPEED=str(speed),
                     FLEET_SIM_MEAN_OUTPUT_TOKENS=str(WORKLOAD_MEAN_TOKENS)) as fleet:
        path = write_chat_prompts(fleet.workdir / "prompts.jsonl", prompts)
        for per_gpu in (1, 2):
            fleet.start_workers(gpus, FLEET_BATCHES_PER_GPU=str(per_gpu))
            note(f"{gpus} workers up with {per_gpu} batch(es) per GPU")
            results[per_gpu] = run_job(fleet, gpus, path, prompts, f"occ-bpg{per_gpu}",
                                       batch_size, WORKLOAD_MAX_NEW_TOKENS, speed)
            fleet.stop_workers()
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 when a goal is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompts", type=int, default=4000)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--speed", type=float, default=18.0)
    parser.add_argument("--batch-size", type=int, default=500)
    args = parser.parse_args(argv)
    res = measure(args.prompts, args.gpus, args.speed, args.batch_size)
    before, after = res[1], res[2]
    occ_b, occ_a = before.timeline.occupancy(), after.timeline.occupancy()
    print(f"\n  before (1 batch/GPU): occupancy {occ_b:.3f}, {before.ratio:.3f} x ideal"
          f"\n  after  (2 batches/GPU): occupancy {occ_a:.3f}, {after.ratio:.3f} x ideal"
          f"\n  after/before: occupancy x{occ_a / occ_b:.3f}, tokens/s "
          f"x{after.tokens_per_s / before.tokens_per_s:.3f}")
    return verdict("bench.occupancy (goal 1)", [
        Goal("busy running slots, 2 batches/GPU", occ_a, OCCUPANCY_GOAL),
        Goal("tokens/s / ideal, 2 batches/GPU", after.ratio, IDEAL_RATIO_GOAL),
    ])


if __name__ == "__main__":
    sys.exit(main())
