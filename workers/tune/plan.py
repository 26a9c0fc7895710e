"""``tune plan``: predicted running cap, throughput, ETA and cost of a job under a profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config.launch_profile import LaunchProfile
from workers.tune.kv_floor import KvNeed, kv_held_requests, need_from_lengths
from workers.tune.memory_model import MemoryModel, catalog_model
from workers.tune.throughput import WORKLOAD, ThroughputModel


@dataclass(frozen=True)
class JobSize:
    """The job to plan for."""

    gpus: int
    prompts: int
    avg_output_tokens: float
    gpu_price_per_hour: float | None = None
    avg_prompt_tokens: float = 0.0
    # The requests' max_new_tokens (None: up to the context), what SGLang's admission budgets.
    max_new_tokens: int | None = None

    def kv_need(self, context_len: int) -> KvNeed:
        """What one running request of this job asks of the KV pool."""
        return need_from_lengths(self.avg_prompt_tokens, self.avg_output_tokens,
                                 self.max_new_tokens, context_len)


def plan(
    profile: LaunchProfile,
    job: JobSize,
    gpu_memory_mib: int,
    model: MemoryModel | None = None,
    throughput: ThroughputModel = WORKLOAD,
) -> dict[str, Any]:
    """Predict the profile's cap with the memory model, the running count its KV pool holds
    for this job's lengths (workers/tune/kv_floor.py), and the job's tok/s, ETA and cost."""
    model = model or catalog_model(profile.flags, gpu_memory_mib, profile.env)
    prediction = model.predict(profile.flags)
    need = job.kv_need(prediction.plan.context_len)
    kv_running = kv_held_requests(prediction.plan.max_total_num_tokens, need)
    running = min(prediction.cap, kv_running)
    bound = "kv" if kv_running < prediction.cap else "cap"
    if profile.client_concurrency and profile.client_concurrency < running:
        running, bound = profile.client_concurrency, "client_concurrency"
    per_gpu = throughput.tok_s(running)
    # One engine per tp-size GPUs (a GPU group, workers/node/gpu_group.py): the cap and tok/s
    # above are one engine's, so the job runs on gpus / tp engines.
    tp = model.engine_flags(profile.flags).tp_size
    engines = max(job.gpus // tp, 1)
    total_tokens = job.prompts * job.avg_output_tokens
    hours = total_tokens / (per_gpu * engines) / 3600 if per_gpu else float("inf")
    out: dict[str, Any] = {
        "profile": profile.name,
        "gpu_memory_mib": gpu_memory_mib,
        "tp_size": tp,
        "engines": engines,
        "predicted": prediction.to_json(),
        "running_per_gpu": running,
        "kv_holds_requests": kv_running,
        "kv_need_per_request": round(need.held),
        "running_bound": bound,
        "tok_s_per_gpu": round(per_gpu),
        "tok_s_total": round(per_gpu * engines),
        "requests_per_s": round(per_gpu * engines / job.avg_output_tokens, 2),
        "eta_hours": round(hours, 1),
        "throughput_model": throughput.source,
        # What the calibration could not read (a snapshot's unknown log lines, version...).
        "unread_evidence": list(model.unread),
    }
    if job.gpu_price_per_hour is not None:
        out["cost"] = round(hours * job.gpus * job.gpu_price_per_hour, 2)
    return out
