"""Issue 37 on the simulator: the fleet choosing its batch size, against a plain client.

One fleet of simulated GPUs (2 by default) runs the job with the batch size ``enqueue`` picks
for it (workers/delivery/batch_size.py, from the live workers' heartbeats) and the elastic hold
(workers/delivery/hold.py); then :mod:`bench.plain_client` sends the same rows straight to the
same engines, 96 requests in flight per server (the seed's; over twice the cap, so the engines'
own queues stay full until the last rows: the plain client's best case, whose tail is the
engine's). Queuing every row at once is no better on this machine: 1,500 open streams per
server make the client, not the engine, the bottleneck. Both are sampled the same way
(``/v1/loads``).

Goals: the fleet's occupancy until its last batch is taken >= 0.99; its whole job's
occupancy >= the plain client's. Occupancy, not tokens/s, is compared: on a 2-core machine the
fleet's own processes slow the simulated engines' clocks, the plain client's do not.

    python -m bench.elastic_hold [--prompts 3000] [--gpus 2] [--speed 20]
"""

from __future__ import annotations

import argparse
import asyncio
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
from bench.engines import LoadSampler
from bench.jobrun import poll_interval_s, run_job
from config.settings import load_settings
from workers.delivery.batch_size import live_budgets, size_for

OCCUPANCY_GOAL = 0.99
PLAIN_IN_FLIGHT = 96


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 when a goal is missed."""
    from bench.plain_client import read_prompts, run_plain

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompts", type=int, default=3000)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--speed", type=float, default=20.0)
    parser.add_argument("--batch-size", type=int, default=0, help="0: the fleet's own choice")
    args = parser.parse_args(argv)
    with local_fleet("elastic", FLEET_SIM_SPEED=str(args.speed),
                     FLEET_SIM_MEAN_OUTPUT_TOKENS=str(WORKLOAD_MEAN_TOKENS)) as fleet:
        path = write_chat_prompts(fleet.workdir / "prompts.jsonl", args.prompts)
        fleet.start_workers(args.gpus)
        # The size enqueue picks given no --batch-size (the same rule, the same heartbeats);
        # passed on so the watcher knows how many batches to wait for.
        size = args.batch_size or size_for(args.prompts, live_budgets(fleet.r, load_settings()),
                                           load_settings().batch_size)
        note(f"the fleet's batch size for {args.prompts} prompts on {args.gpus} GPUs: {size}")
        run = run_job(fleet, args.gpus, path, args.prompts, "elastic", size,
                      WORKLOAD_MAX_NEW_TOKENS, args.speed)
        urls = [fleet.engine_url(g) for g in range(args.gpus)]
        rows = read_prompts(path)
        with LoadSampler(urls, [run.model.cap] * args.gpus, poll_interval_s(args.gpus)) as s:
            plain = asyncio.run(run_plain(urls, rows, PLAIN_IN_FLIGHT, WORKLOAD_MAX_NEW_TOKENS))
        plain_occ = s.occupancy()
        note(f"plain client, {PLAIN_IN_FLIGHT} in flight per server: {plain.completed} done, "
             f"{plain.seconds:.1f} s, occupancy {plain_occ:.3f}")
    tl = run.timeline
    whole, to_last = tl.occupancy(whole=True), tl.occupancy_to_last_row()
    print(f"\n  fleet: occupancy until the last batch was taken {tl.occupancy():.3f}; whole job "
          f"until its last row {to_last:.3f} ({tl.end_to_end_s:.1f} s), until its last result "
          f"was stored {whole:.3f}; tail share {tl.tail_share:.3f}; "
          f"{run.splits[0]} parts split off ({run.splits[1]} rows)"
          f"\n  plain: occupancy {plain_occ:.3f} ({plain.seconds:.1f} s)")
    return verdict("bench.elastic_hold (issue 37)", [
        Goal("occupancy until the last batch is taken", tl.occupancy(), OCCUPANCY_GOAL),
        Goal("whole-job occupancy (to its last row) / the plain client's",
             to_last / max(plain_occ, 1e-9), 1.0)])


if __name__ == "__main__":
    sys.exit(main())
