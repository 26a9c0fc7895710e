"""Run one job through a running fleet and measure it from the engines' side and the job's."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import Fleet, MachineCpu, note
from bench.engines import EngineModel, JobWatch, Timeline, engine_model
from workers.delivery import jobstate
from workers.redisdb.keys import JobKeys


def poll_interval_s(gpus: int) -> float:
    """How often each engine's /v1/loads is read.

    Enough samples for a mean over a minute while costing the engines little: each read costs
    the simulator about a millisecond of CPU, so more engines are read less often.
    """
    return max(0.2, 0.1 * gpus)


@dataclass(frozen=True)
class JobResult:
    """Figures of one job run."""

    label: str
    prompts: int
    gpus: int
    timeline: Timeline
    output_tokens: int
    model: EngineModel
    cpu_busy: float  # fraction of the machine's cores busy during the job
    cpu_cores: dict[str, float]  # cores used on average by workers, engines, Redis
    splits: tuple[int, int] = (0, 0)  # parts split off batches at the job's end, their rows

    @property
    def ideal_tokens_per_s(self) -> float:
        """Every engine at its cap for the whole job (the simulator's throughput model)."""
        return self.model.ideal_tokens_per_s * self.gpus

    @property
    def tokens_per_s(self) -> float:
        """The whole job: engine decode tokens/s from the first request (the sample that saw
        it, where the counter was read too) until the last batch was stored."""
        return self.timeline.whole_decode_rate()

    @property
    def ratio(self) -> float:
        """End-to-end tokens/s over the ideal bound."""
        return self.tokens_per_s / self.ideal_tokens_per_s

    @property
    def steady_ratio(self) -> float:
        """Engine decode tokens/s until the last batch was taken, over the ideal bound."""
        return self.timeline.steady_decode_rate() / self.ideal_tokens_per_s

    def summary(self) -> str:
        """One line with every figure of the run."""
        tl = self.timeline
        e2e = (f"whole job {tl.end_to_end_s:.1f} s, {self.tokens_per_s:,.0f} tok/s = "
               f"{self.ratio:.3f} x ideal ({self.ideal_tokens_per_s:,.0f}), occupancy "
               f"{tl.occupancy(whole=True):.3f}, tail {tl.tail_share:.1%} of the time; "
               if tl.t_done else "")
        cores = ", ".join(f"{k} {v:.2f}" for k, v in self.cpu_cores.items())
        return (f"{self.label}: {self.prompts} prompts on {self.gpus} GPU(s): {e2e}"
                f"until the last batch was taken: occupancy {tl.occupancy():.3f}, "
                f"{self.steady_ratio:.3f} x ideal, {tl.mean_waiting():.0f} requests queued at "
                f"the engines on average; machine CPU {self.cpu_busy:.0%} "
                f"(cores: {cores})")


def run_job(fleet: Fleet, gpus: int, prompts: Path, n_prompts: int, job: str, batch_size: int,
            max_new_tokens: int, speed: float, timeout_s: float = 900,
            stop_when_all_taken: bool = False) -> JobResult:
    """Enqueue ``prompts`` as ``job`` on the fleet's workers and wait until it is done.

    With ``stop_when_all_taken`` the job is cancelled as soon as its last batch has been taken
    from the queue: the window every steady-state figure is measured over has ended.
    """
    urls = [fleet.engine_url(g) for g in range(gpus)]
    model = engine_model(urls[0], speed)
    n_batches = math.ceil(n_prompts / batch_size)
    cpu, cpu_before = MachineCpu(), fleet.cpu_seconds()
    t0 = time.monotonic()
    with JobWatch(urls, [model.cap] * gpus, fleet.r, job, n_batches,
                  poll_interval_s(gpus)) as watch:
        fleet.producer("enqueue", str(prompts), "--job", job, "--batch-size", str(batch_size),
                       "--max-new-tokens", str(max_new_tokens))
        note(f"{job}: enqueued {n_batches} batches in {time.monotonic() - t0:.1f} s")
        timeline = watch.wait(timeout_s, all_taken=stop_when_all_taken)
    span = max(time.monotonic() - t0, 1e-9)
    cores = {k: (v - cpu_before[k]) / span for k, v in fleet.cpu_seconds().items()}
    busy = cpu.busy()
    if stop_when_all_taken:
        fleet.producer("cancel", "--job", job)
    tokens = jobstate.counters(fleet.r, job)["output_tokens"]
    parts, split_rows = (int(n or 0) for n in fleet.r.hmget(JobKeys(job).job,
                                                             list(jobstate.SPLIT_FIELDS)))
    result = JobResult(label=job, prompts=n_prompts, gpus=gpus, timeline=timeline,
                       output_tokens=tokens, model=model, cpu_busy=busy, cpu_cores=cores,
                       splits=(parts, split_rows))
    note(result.summary())
    return result
