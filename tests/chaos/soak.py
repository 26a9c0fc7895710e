"""``make soak``: run seeded schedules one after another for a while, then print a summary.

``python -m tests.chaos.soak [--minutes 30] [--first-seed N]`` runs
``tests/test_schedule.py::test_soak`` under pytest (the fixtures start Redis and moto's
server) with the duration and first seed in FLEET_SOAK_MINUTES / FLEET_SOAK_FIRST_SEED. The
summary counts schedules, faults, operator actions, prompts, lost and duplicated prompts, and
lists every failing seed with the command that replays it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.chaos.runner import Outcome

ROOT = Path(__file__).resolve().parents[2]


def summary(outcomes: Iterable[Outcome], minutes: float) -> str:
    """The soak's figures, and every failing seed with its replay command."""
    outcomes = list(outcomes)
    kinds: Counter[str] = Counter(s.kind for o in outcomes for s in o.schedule.steps)
    failed = [o for o in outcomes if not o.ok]
    lines = [
        f"soak: {len(outcomes)} schedules in {minutes:.1f} min "
        f"({sum(o.schedule.store == 's3' for o in outcomes)} on S3 through the proxy)",
        f"  faults: {sum(o.faults for o in outcomes)}   operator actions: "
        f"{sum(o.actions for o in outcomes)}",
        "  by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())),
        f"  prompts: {sum(o.prompts for o in outcomes)}   lost: "
        f"{sum(o.lost for o in outcomes)}   duplicated: {sum(o.duplicated for o in outcomes)}",
        f"  batches split at the job's end: {sum(o.splits for o in outcomes)} parts in "
        f"{sum(o.splits > 0 for o in outcomes)} schedules",
        f"  failing schedules: {len(failed)}",
    ]
    for o in failed:
        lines.append(f"    seed {o.schedule.seed} ({o.schedule.store}): "
                     + " ".join(s.kind for s in o.schedule.steps))
        lines += [f"      {v[:200]}" for v in o.violations]
        lines.append(f"      replay: {o.replay()}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tests.chaos.soak``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0,
                        help="how long to keep starting schedules (default 30)")
    parser.add_argument("--first-seed", type=int, default=None,
                        help="seed of the first schedule (default: a random one, printed)")
    args = parser.parse_args(argv)
    first = args.first_seed if args.first_seed is not None else random.randrange(10**6)
    os.environ["FLEET_SOAK_MINUTES"] = str(args.minutes)
    os.environ["FLEET_SOAK_FIRST_SEED"] = str(first)
    print(f"soak: {args.minutes:g} minutes from seed {first}", flush=True)
    os.chdir(ROOT)
    return int(pytest.main(["tests/test_schedule.py::test_soak", "-m", "soak", "-s", "-q",
                            "-p", "no:cacheprovider"]))


if __name__ == "__main__":
    sys.exit(main())
