"""Does the in-flight budget empty the engine when its running requests finish together?

Issue 29: on the real engine the fleet's engine was full 0.963 of the time against 0.994 for a
plain client with 96 in flight, on rows of exactly 500 tokens. The fleet keeps
``ceil(cap x 1.25) + 1`` requests in flight per GPU (51 at cap 40): when the 40 running finish
on the same step only 11 are waiting in the engine, where the plain client has 56. This runs
the GPU check on the simulator calibrated from that engine (``FLEET_SIM_CALIBRATION=h200-dummy``:
its decode step, and a fixed 128 ms per prefill round, which is what a refill in several
small rounds costs) at real speed, for each length shape (fixed, the workload's log-normal)
and each headroom (the default 1.25, and 2.0: a whole cap waiting), the fleet's job and then
the plain client on the same rows and the same engine:

    python -m bench.inflight_budget [--prompts 120 --batch-size 40 --headrooms 1.25,2.0]

It prints, per run, the fleet's occupancy until its last batch was taken and over the whole
job, the plain client's, and fleet ÷ plain (decode tokens/s). Not a goal: it decides whether
the budget is what the real engine's occupancy lost.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench import gpu_check

SHAPES = {"fixed": 0.0, "log-normal": gpu_check.WORKLOAD_SIGMA}


def one_run(shape: str, headroom: float, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One GPU check on the simulator; the figures this script compares."""
    before = set(out.glob("gpu-check-*.json"))
    argv = ["--engine", "sim", "--gpus", "1", "--prompts", str(args.prompts),
            "--batch-size", str(args.batch_size), "--mean-tokens", str(args.mean_tokens),
            "--sigma", str(SHAPES[shape]), "--max-new-tokens", str(args.max_new_tokens),
            "--fixed-tokens", "0", "--plain", "96", "--headroom", str(headroom),
            "--out", str(out), "--seed", str(args.seed)]
    gpu_check.main(argv)
    [path] = sorted(set(out.glob("gpu-check-*.json")) - before)[-1:]
    s = json.loads(path.read_text())
    job, plain = s["job"], s["plain"][0]
    return {"shape": shape, "headroom": headroom,
            "in_flight": math.ceil(s["workers"][0]["cap"] * headroom) + 1,
            "fleet_occupancy_until_all_taken": job["occupancy_until_all_taken"],
            "fleet_occupancy_whole": job["occupancy"], "fleet_mean_waiting": job["mean_waiting"],
            "fleet_decode_tok_s": job["decode_tok_s"], "plain_occupancy": plain["occupancy"],
            "plain_decode_tok_s": plain["decode_tok_s"], "fleet_ratio": plain["fleet_ratio"],
            "summary": path.name}


def main(argv: list[str] | None = None) -> int:
    """Run every shape x headroom; print and keep the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--prompts", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=40)
    ap.add_argument("--mean-tokens", type=float, default=500.0)
    ap.add_argument("--max-new-tokens", type=int, default=1500)
    ap.add_argument("--headrooms", default="1.25,2.0")
    ap.add_argument("--shapes", default="fixed,log-normal")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    os.environ.setdefault("FLEET_SIM_CALIBRATION", "h200-dummy")
    os.environ.setdefault("FLEET_SIM_SPEED", "1")
    runs_dir = args.out / "inflight-budget-runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        for headroom in (float(h) for h in args.headrooms.split(",")):
            rows.append(one_run(shape, headroom, args, runs_dir))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = {"date": stamp, "calibration": os.environ["FLEET_SIM_CALIBRATION"],
              "speed": os.environ["FLEET_SIM_SPEED"], "argv": sys.argv[1:] if argv is None
              else argv, "runs": rows}
    (args.out / f"inflight-budget-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'shape':<11} {'headroom':>8} {'in flight':>9} {'occ. until taken':>16} "
          f"{'occ. whole':>10} {'plain occ.':>10} {'fleet/plain':>11}")
    for r in rows:
        print(f"{r['shape']:<11} {r['headroom']:>8} {r['in_flight']:>9} "
              f"{r['fleet_occupancy_until_all_taken']:>16} {r['fleet_occupancy_whole']:>10} "
              f"{r['plain_occupancy']:>10} {r['fleet_ratio']:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
