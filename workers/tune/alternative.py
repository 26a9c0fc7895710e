"""``tune plan``'s second column: what the tuner would launch on that GPU instead of a profile.

The same option search ``diagnose`` runs on a live engine (running-cap levers sized to the
largest running count that fits, lossless first), here fed by the memory model alone: no cache
hit rate is known, so the no-radix lever is never chosen, and no free memory beyond the
profile's own fraction is assumed.
"""

from __future__ import annotations

from config.launch_profile import LaunchProfile
from workers.tune.flags import apply_changes
from workers.tune.kv_floor import KvNeed, need_from_context
from workers.tune.levers import Situation, choose, running_cap_options
from workers.tune.memory_model import MemoryModel
from workers.tune.throughput import WORKLOAD, ThroughputModel


def tuner_profile(profile: LaunchProfile, model: MemoryModel, allow_lossy: bool = False,
                  throughput: ThroughputModel = WORKLOAD,
                  need: KvNeed | None = None) -> LaunchProfile | None:
    """The profile the tuner would launch instead (None when it finds nothing better); lossy
    levers (bf16 SSM state) only with ``allow_lossy``, as ``tune auto`` does. ``need``: the
    job's KV need per running request (default: every request to the context)."""
    now = model.predict(profile.flags)
    context_len = int(profile.flag("context-length") or now.plan.context_len)
    sit = Situation(
        flags=dict(profile.flags),
        current_cap=now.cap,
        context_len=context_len,
        # The job's lengths when given, else every request to the context, as
        # situation.kv_need_per_request does without the job's figures.
        kv_need=need or need_from_context(context_len),
        cache_hit_rate=None,
        prefill_share=None,
        fraction=now.plan.mem_fraction_static,
        extra_fraction=0.0,
        throughput=throughput,
    )
    options = [o for o in running_cap_options(model, sit) if allow_lossy or not o.lossy]
    chosen = choose(options)
    now_running = min(now.cap, sit.kv_running(now))
    if chosen is None or chosen.tok_s <= throughput.tok_s(now_running):
        return None
    return profile.model_copy(update={
        "name": f"{profile.name}+{chosen.name}",
        "flags": apply_changes(profile.flags, chosen.changes),
        "client_concurrency": None,
    })
