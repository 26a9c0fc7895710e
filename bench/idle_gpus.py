"""Issue 37 at a node's size: 7 simulated GPUs, 20,000 heavy-tailed prompts, idle GPU-seconds.

The fleet chooses the batch size (workers/delivery/batch_size.py) and runs the job to its end
with the elastic hold and the job-end split (workers/split/). The output lengths are
the simulator's log-normal at the workload's mean (sigma 0.8 by default, ``--sigma``). A
watcher reads every engine, from the engines' side only:

- ``/v1/loads``: each engine's running and waiting requests;
- ``/metrics``: ``sglang:num_requests_total``, the requests each engine has finished.

A row is *unsent* while the engines together have seen (finished + running + waiting) fewer
requests than the job has rows. A GPU is *idle* in a sample when its engine runs nothing and
queues nothing. Idle GPU-seconds are counted only while some row is unsent (a GPU idle at the
job's very end, when every row is already running elsewhere, is the engine's tail, not the
fleet's). The goal: idle GPU-seconds while any row is unsent <= 1 % of the job's GPU-seconds
(GPUs x the seconds from the first request until the job is done). The share of running slots
left empty over the same window is printed beside it.

The simulator's speed is set so that the 7 engines at their cap finish ``--requests-per-s``
(80 by default, what this machine's two cores carry; bench/scaling.py): the job takes about
five minutes here.

    python -m bench.idle_gpus [--prompts 20000] [--gpus 7] [--sigma 0.8] [--requests-per-s 80]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import httpx
import orjson

from bench.common import (
    WORKLOAD_MAX_NEW_TOKENS,
    WORKLOAD_MEAN_TOKENS,
    Goal,
    local_fleet,
    note,
    verdict,
    write_chat_prompts,
)
from bench.engines import Poller, parse_counter
from bench.jobrun import run_job
from bench.scaling import speed_for
from config.settings import load_settings
from workers.delivery.batch_size import live_budgets, size_for

IDLE_GOAL = 0.01
SAMPLE_S = 0.5


@dataclass(frozen=True)
class EngineSample:
    """One look at every engine."""

    t: float
    running: tuple[int, ...]
    waiting: tuple[int, ...]
    seen: int  # requests finished, running or waiting, all engines


class IdleWatch(Poller):
    """A thread sampling every engine's running, waiting and finished requests."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(SAMPLE_S, name="idle-watch")
        self.urls = urls
        self.samples: list[EngineSample] = []

    def _look(self, http: httpx.Client) -> EngineSample:
        running, waiting, finished = [], [], 0.0
        for url in self.urls:
            entry = orjson.loads(http.get(f"{url}/v1/loads").content)["loads"][0]
            running.append(int(entry["num_running_reqs"]))
            waiting.append(int(entry["num_waiting_reqs"]))
            finished += parse_counter(http.get(f"{url}/metrics").text,
                                      "sglang:num_requests_total")
        return EngineSample(time.monotonic(), tuple(running), tuple(waiting),
                            int(finished) + sum(running) + sum(waiting))

    def tick(self, http: httpx.Client) -> None:
        try:
            self.samples.append(self._look(http))
        except httpx.HTTPError:
            pass  # an engine restarting: no sample rather than a false idle


@dataclass(frozen=True)
class IdleFigures:
    """What the samples say about one job."""

    idle_gpu_s: float  # GPU-seconds with nothing running or queued while a row was unsent
    job_gpu_s: float  # GPUs x seconds from the first request until the job was done
    empty_slot_share: float  # running slots left empty while a row was unsent
    unsent_s: float  # seconds from the first request until every row had been sent
    ramp_idle_gpu_s: float = 0.0  # the part of idle_gpu_s before a GPU ran its first request

    @property
    def idle_share(self) -> float:
        """Idle GPU-seconds while any row is unsent over the job's GPU-seconds."""
        return self.idle_gpu_s / max(self.job_gpu_s, 1e-9)


def idle_figures(samples: list[EngineSample], rows: int, cap: int, t_done: float
                 ) -> IdleFigures:
    """Each sample stands for the time until the next one."""
    first = next((i for i, s in enumerate(samples) if sum(s.running) > 0), None)
    if first is None:
        return IdleFigures(0.0, 0.0, 0.0, 0.0)
    window = [s for s in samples[first:] if s.t <= t_done]
    gpus = len(window[0].running)
    idle = ramp = empty = span = 0.0
    started = [False] * gpus
    last_unsent = window[0].t
    for now, nxt in zip(window, [*window[1:], None], strict=True):
        if now.seen >= rows:
            break
        dt = (nxt.t if nxt else t_done) - now.t
        for g, (run, wait) in enumerate(zip(now.running, now.waiting, strict=True)):
            started[g] = started[g] or run > 0
            if run == 0 and wait == 0:
                idle += dt
                ramp += 0.0 if started[g] else dt
        empty += dt * sum(max(0, cap - run) for run in now.running) / cap
        span += dt
        last_unsent = now.t + dt
    return IdleFigures(idle_gpu_s=idle, job_gpu_s=gpus * (t_done - window[0].t),
                       empty_slot_share=empty / max(gpus * span, 1e-9),
                       unsent_s=last_unsent - window[0].t, ramp_idle_gpu_s=ramp)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 when the goal is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompts", type=int, default=20_000)
    parser.add_argument("--gpus", type=int, default=7)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--requests-per-s", type=float, default=80.0)
    args = parser.parse_args(argv)
    speed = speed_for(args.gpus, args.requests_per_s)
    with local_fleet("idle", FLEET_SIM_SPEED=f"{speed:.4f}",
                     FLEET_SIM_MEAN_OUTPUT_TOKENS=str(WORKLOAD_MEAN_TOKENS),
                     FLEET_SIM_OUTPUT_SIGMA=str(args.sigma)) as fleet:
        path = write_chat_prompts(fleet.workdir / "prompts.jsonl", args.prompts)
        fleet.start_workers(args.gpus)
        settings = load_settings()
        size = size_for(args.prompts, live_budgets(fleet.r, settings), settings.batch_size)
        note(f"{args.gpus} workers up, engine speed x{speed:.2f}; the fleet's batch size for "
             f"{args.prompts} prompts: {size}")
        urls = [fleet.engine_url(g) for g in range(args.gpus)]
        with IdleWatch(urls) as watch:
            run = run_job(fleet, args.gpus, path, args.prompts, "idle", size,
                          WORKLOAD_MAX_NEW_TOKENS, speed, timeout_s=3600)
    tl = run.timeline
    fig = idle_figures(watch.samples, args.prompts, run.model.cap, tl.t_done or time.monotonic())
    print(f"\n  {args.gpus} GPUs, {args.prompts} prompts (sigma {args.sigma}), batches of {size}:"
          f" whole job {tl.end_to_end_s:.0f} s, every row sent after {fig.unsent_s:.0f} s;"
          f"\n  while a row was unsent: {fig.idle_gpu_s:.1f} idle GPU-seconds of "
          f"{fig.job_gpu_s:.0f} ({fig.idle_share:.2%}; {fig.ramp_idle_gpu_s:.1f} of them before "
          f"a GPU's first request), running slots empty "
          f"{fig.empty_slot_share:.2%}; whole-job occupancy {tl.occupancy(whole=True):.3f}, "
          f"tail {tl.tail_share:.1%}; {run.splits[0]} parts split off ({run.splits[1]} rows)")
    return verdict("bench.idle_gpus (issue 37)", [
        Goal("idle GPU-seconds while a row is unsent / the job's GPU-seconds", fig.idle_share,
             IDLE_GOAL, at_most=True)])


if __name__ == "__main__":
    sys.exit(main())
