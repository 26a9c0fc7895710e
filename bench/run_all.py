"""``make bench``: run every benchmark, one process each, and sum up which goals were met.

    python -m bench.run_all [--only occupancy vs_plain ...]

Each benchmark prints its figures beside its goals and exits 1 when one is missed; this runs
them in turn (a failing one does not stop the others) and exits 1 if any of them did.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench.common import ROOT, machine

# Cheapest first, so a broken setup shows early.
BENCHMARKS = ("exports", "overhead", "control_plane", "quality", "redis_peak", "s3_staging",
              "occupancy", "vs_plain", "elastic_hold", "idle_gpus", "scaling", "tuner_gain")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks; exit status 1 if any goal was missed or a benchmark broke."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    args = parser.parse_args(argv)
    print(f"bench on {machine()}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    codes: dict[str, tuple[int, float]] = {}
    for name in args.only:
        print(f"\n### python -m bench.{name}", flush=True)
        t0 = time.monotonic()
        code = subprocess.call([sys.executable, "-m", f"bench.{name}"], cwd=ROOT)
        codes[name] = (code, time.monotonic() - t0)
    print("\n### summary")
    for name, (code, secs) in codes.items():
        state = {0: "all goals met", 1: "goal(s) missed"}.get(code, f"broke (exit {code})")
        print(f"  bench.{name:<14} {state:<16} {secs:6.0f} s")
    return 0 if all(code == 0 for code, _ in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
