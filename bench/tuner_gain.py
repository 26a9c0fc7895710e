"""The tuner's gain on the simulator, measured in one run (issue 5, "Done when").

Two GPU workers start on the real run's first profile (``qwen36-27b-baseline``: 80 Mamba
slots under extra_buffer + MTP, so the engine caps itself at 16 running); a job keeps them
busy; ``python -m workers.tune auto`` diagnoses, re-tunes the canary, keeps the better profile
and rolls it out. The figure is the canary's engine throughput after / before, as the tuner
measured it from ``sglang:realtime_tokens_total`` (not a client-side count). Then the job must
finish with ``verify`` ok: a re-tune loses no prompt.

    python -m bench.tuner_gain [--prompts 1100] [--speed 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench.common import ROOT, Goal, local_fleet, verdict, write_chat_prompts

GOAL_GAIN = 1.75  # issue 5's test goal, from the real run: 2,000 -> 3,500 tok/s per GPU
MAX_TRIALS = 3


def main(argv: list[str] | None = None) -> int:
    """Run the tuner against a baseline fleet; print gain, trials and verify beside goals."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompts", type=int, default=1100)
    parser.add_argument("--speed", default="8")
    args = parser.parse_args(argv)
    sim = {"FLEET_PROFILE": "qwen36-27b-baseline", "FLEET_SIM_SPEED": args.speed,
           "FLEET_SIM_MEAN_OUTPUT_TOKENS": "2490", "FLEET_ENGINE_STOP_GRACE_S": "2"}
    with local_fleet("tuner", **sim) as fleet:
        fleet.start_workers(2)
        prompts = write_chat_prompts(fleet.workdir / "prompts.jsonl", args.prompts)
        fleet.producer("enqueue", str(prompts), "--job", "tune", "--batch-size", "100",
                       "--max-new-tokens", "4000")
        res = subprocess.run(
            [sys.executable, "-m", "workers.tune", "auto", "--canary", "gpu0", "--window-s", "3",
             "--settle-timeout-s", "30", "--restart-timeout-s", "60",
             "--max-trials", str(MAX_TRIALS)],
            env=fleet.env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            print(res.stderr[-2000:], file=sys.stderr)
            return 1
        report = json.loads(res.stdout)
        for trial in report["trials"]:
            print(f"  trial {trial['new_profile']}: {trial['reason']}")
        fleet.producer("status", "--job", "tune", "--watch", "--json", "--interval", "2",
                       timeout_s=900)
        check = json.loads(fleet.producer("verify", "--job", "tune", "--json").stdout)
    return verdict("tuner gain on the simulator (from qwen36-27b-baseline)", [
        Goal("canary tok/s after / before", report["gain"], GOAL_GAIN, "x"),
        Goal("trial restarts", len(report["trials"]), MAX_TRIALS, at_most=True),
        Goal("verify ok (1 = yes)", float(check["ok"]), 1.0),
        Goal("prompts missing", check["missing"], 0, at_most=True),
    ])


if __name__ == "__main__":
    sys.exit(main())
