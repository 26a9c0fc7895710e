"""Issue 14, finding 3: a seeded event model of a job's tail, to choose the design that shortens it.

This is a model, not a measurement (``bench/scaling.py`` measures). It replays the batch
schedule the workers follow, with no processes and no clock, so the design choices can be
compared on the same draws in seconds:

- ``gpus`` engines of ``cap`` running slots; request durations are the workload's output
  lengths (log-normal, mean 2,490 tokens, sigma 0.8, capped at 7,000) at 87.5 tokens/s;
- the fleet: the job's batches in one FIFO queue; a GPU holds ``hold`` batches
  (``FLEET_BATCHES_PER_GPU``: one per pool process) and takes the next when one is stored
  (1 s after its last answer); its slots go to the oldest held batch first
  (workers/delivery/gpu_share.py);
- the plain client (bench/plain_client.py): every prompt in one list, each freed slot takes
  the next.

Variants: ``hold`` 2 (the default) or 3; a tapered tail (the last ``2 x gpus x batch`` prompts
cut into batches of ``ceil(left / 2 gpus)``, no smaller than ``batch / 4``: guided
self-scheduling); and, as an upper bound, prompt-level stealing (a GPU with free slots and
nothing unsent of its own takes the unsent prompts of other GPUs' batches).

    python -m bench.tail_model [--gpus 1 7] [--batch-sizes 100 500] [--batches-per-gpu 20]
                               [--seeds 1 2 3]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from dataclasses import dataclass, field

from bench.common import WORKLOAD_MAX_NEW_TOKENS, WORKLOAD_MEAN_TOKENS

SIGMA = 0.8
TOKENS_PER_S = 87.5  # one request's decode rate at the engine's cap (3.5 tokens x 25 steps/s)
CAP = 40
STORE_S = 1.0


def durations(n: int, seed: int) -> list[float]:
    """Seconds each of ``n`` requests decodes for."""
    rnd = random.Random(seed)
    mu = math.log(WORKLOAD_MEAN_TOKENS) - SIGMA ** 2 / 2
    return [min(WORKLOAD_MAX_NEW_TOKENS, rnd.lognormvariate(mu, SIGMA)) / TOKENS_PER_S
            for _ in range(n)]


def cut(total: int, batch: int, taper_gpus: int = 0) -> list[int]:
    """Batch sizes: all ``batch``, or with the last ``2 x taper_gpus x batch`` prompts tapered."""
    sizes, left = [], total
    window = 2 * taper_gpus * batch if taper_gpus else 0
    while left > window:
        sizes.append(min(batch, left))
        left -= sizes[-1]
    while left > 0:
        size = min(left, batch, max(batch // 4, math.ceil(left / (2 * taper_gpus))))
        sizes.append(size)
        left -= size
    return sizes


@dataclass(eq=False)  # identity: two drained batches are not the same batch
class _Batch:
    unsent: list[float]
    left: int


@dataclass
class _Gpu:
    held: list[_Batch] = field(default_factory=list)
    running: int = 0


class _Fleet:
    """The workers' schedule, one event at a time."""

    def __init__(self, batches: list[_Batch], gpus: int, hold: int, steal: bool) -> None:
        self.queue = batches[::-1]
        self.nodes = [_Gpu() for _ in range(gpus)]
        self.hold, self.steal = hold, steal
        # (time, seq, stored?, gpu, batch): an answer on ``gpu``, or ``batch`` stored
        self.events: list[tuple[float, int, bool, int, _Batch]] = []
        self.seq = 0

    def _push(self, t: float, stored: bool, g: int, b: _Batch) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, stored, g, b))

    def _send(self, g: int, b: _Batch, t: float) -> None:
        node = self.nodes[g]
        while node.running < CAP and b.unsent:
            node.running += 1
            self._push(t + b.unsent.pop(), False, g, b)

    def _fill(self, g: int, t: float) -> None:
        node = self.nodes[g]
        while len(node.held) < self.hold and self.queue:
            node.held.append(self.queue.pop())
        for b in node.held:  # oldest first
            self._send(g, b, t)
        if self.steal and not self.queue:
            donors = [b for n in self.nodes if n is not node for b in n.held if b.unsent]
            for b in sorted(donors, key=lambda d: -len(d.unsent)):
                self._send(g, b, t)

    def run(self) -> float:
        """Makespan: the time the last batch is stored."""
        for g in range(len(self.nodes)):
            self._fill(g, 0.0)
        end = 0.0
        while self.events:
            end, _, stored, g, b = heapq.heappop(self.events)
            if stored:
                self.nodes[g].held.remove(b)
            else:
                self.nodes[g].running -= 1
                b.left -= 1
                if b.left == 0:
                    owner = next(i for i, n in enumerate(self.nodes) if b in n.held)
                    self._push(end + STORE_S, True, owner, b)
            for i in range(len(self.nodes)):
                self._fill(i, end)
        return end


def fleet(durs: list[float], sizes: list[int], gpus: int, hold: int = 2, steal: bool = False
          ) -> float:
    """Makespan of the fleet's schedule."""
    batches, at = [], 0
    for size in sizes:
        batches.append(_Batch(durs[at:at + size], size))
        at += size
    return _Fleet(batches, gpus, hold, steal).run()


def plain(durs: list[float], gpus: int) -> tuple[float, float]:
    """(makespan, occupancy) of the plain client pulling prompt by prompt."""
    slots = [0.0] * (gpus * CAP)
    end = 0.0
    for d in durs:
        start = heapq.heappop(slots)
        heapq.heappush(slots, start + d)
        end = max(end, start + d)
    return end, sum(durs) / (gpus * CAP * end)


def main(argv: list[str] | None = None) -> int:
    """Print the plain client's occupancy and each variant's fleet / plain (time ratio)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 7])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--batches-per-gpu", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args(argv)
    variants = {"hold 2 (default)": {}, "hold 3": {"hold": 3}, "tapered tail": {"taper": True},
                "tapered, hold 3": {"taper": True, "hold": 3},
                "prompt stealing": {"steal": True}}
    print("model (not a measurement): whole-job occupancy / fleet vs plain client, "
          f"mean of seeds {args.seeds}")
    n = len(args.seeds)
    for gpus in args.gpus:
        for batch in args.batch_sizes:
            total = gpus * batch * args.batches_per_gpu
            # Each seed's draws and the plain client's run on them, shared by every variant.
            runs = [(durs, *plain(durs, gpus))
                    for durs in (durations(total, seed) for seed in args.seeds)]
            plain_occ = sum(p_occ for _, _, p_occ in runs) / n
            cells = []
            for name, v in variants.items():
                sizes = cut(total, batch, gpus if v.get("taper") else 0)
                ends = [(sum(durs), plain_end,
                         fleet(durs, sizes, gpus, v.get("hold", 2), v.get("steal", False)))
                        for durs, plain_end, _ in runs]
                occ = sum(work / (gpus * CAP * end) for work, _, end in ends) / n
                ratio = sum(plain_end / end for _, plain_end, end in ends) / n
                cells.append(f"{name} {occ:.3f} / {ratio:.3f}")
            print(f"  {gpus} GPU(s), batches of {batch} (cap {CAP}), plain occupancy "
                  f"{plain_occ:.3f}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
