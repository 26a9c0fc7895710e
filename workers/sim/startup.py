"""The simulated engine start: SGLang's startup log lines with the CapacityPlan's numbers.

The sequence and f-strings are SGLang's (``model_runner.py``, ``memory_pool.py``,
``cuda_graph_runner.py``, ``scheduler.py``), in the played release's words where they changed
(:mod:`workers.sim.formats`). Only the elapsed times are the sim's own: the whole
start takes FLEET_SIM_STARTUP_S real seconds (60 % "loading weights", 10 % pools, 25 % graphs).
As in SGLang (``http_server.launch_server`` starts uvicorn only once the scheduler processes
report ready), nothing listens on the port meanwhile: connections are refused, not answered 503.
"""

from __future__ import annotations

import asyncio
import time

from workers.engine.capacity import mamba_breakdown_gib, resolved_mamba_strategy
from workers.engine.releases import Traits
from workers.sim.formats import graph_lines, kv_line, sim_release
from workers.sim.report import log
from workers.sim.state import SimState

LOAD_SHARE, POOL_SHARE, GRAPH_SHARE = 0.6, 0.1, 0.25


def capture_batch_sizes(speculative: bool, max_bs: int, cap: int) -> list[int]:
    """Default ``cuda_graph_bs`` list, clipped to ``cuda_graph_max_bs`` and the running cap."""
    if speculative:
        sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8)]
        sizes += list(range(272, max_bs + 1, 16))
    else:
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16)]
        sizes += list(range(512, max_bs + 1, 32))
    limit = min(max_bs, cap)
    sizes = [bs for bs in sizes if bs <= limit]
    if cap < max_bs and cap not in sizes:
        sizes.append(cap)  # get_batch_sizes_to_capture adds the req pool size (inferred)
    return sizes


def warnings(state: SimState) -> list[str]:
    """Warnings ServerArgs prints while resolving the flags."""
    flags, lines = state.flags, []
    release = sim_release(state.version)
    lines.append(
        f"workers.sim: simulated SGLang engine, no model loaded; caps and memory from "
        f"workers.engine.capacity, step times from the measured workload, speed x{state.speed:g}"
    )
    if flags.speculative_algorithm and flags.max_running_requests is None:
        lines.append(
            "Max running requests is reset to 48 for speculative decoding. You can override "
            "this by explicitly setting --max-running-requests."
        )
    no_buffer = resolved_mamba_strategy(flags) == "no_buffer"
    if state.shape.hybrid and no_buffer and not flags.disable_radix_cache and \
            release.overlap_off_line:
        if not flags.disable_overlap_schedule and not flags.speculative_algorithm:
            lines.append(
                "Disabling overlap schedule since mamba no_buffer is not compatible with overlap "
                "schedule, try to use --disable-radix-cache if overlap schedule is necessary"
            )
    if state.args.dp_size > 1:
        lines.append(f"workers.sim: --dp-size {state.args.dp_size} is not simulated (one rank)")
    return lines


def pool_lines(state: SimState, release: Traits) -> list[str]:
    """The Mamba and KV pool allocation lines."""
    plan, mem, lines = state.plan, state.plan.memory_gib, []
    if state.shape.hybrid:
        parts = mamba_breakdown_gib(state.shape, state.flags, plan)
        line = (
            f"Mamba Cache is allocated. max_mamba_cache_size: {plan.max_mamba_cache_size}, "
            f"conv_state size: {parts['conv_state']:.2f}GB, "
            f"ssm_state size: {parts['ssm_state']:.2f}GB "
        )
        if state.speculative:
            line += (
                f"intermediate_ssm_state_cache size: "
                f"{parts['intermediate_ssm_state_cache']:.2f}GB "
                f"intermediate_conv_window_cache size: "
                f"{parts['intermediate_conv_window_cache']:.2f}GB "
            )
        lines.append(line)
    half = mem["kv"] / 2
    lines.append(kv_line(release, plan.max_total_num_tokens, half, half,
                         state.flags.kv_cache_dtype))
    return lines


def scheduler_line(state: SimState, available_gb: float) -> str:
    """The scheduler's capacity line (the one to parse for the effective cap)."""
    plan = state.plan
    return (
        f"max_total_num_tokens={plan.max_total_num_tokens}, "
        f"chunked_prefill_size={plan.chunked_prefill_size}, "
        f"max_prefill_tokens={plan.max_prefill_tokens}, "
        f"max_running_requests={plan.max_running_requests}, "
        f"context_len={plan.context_len}, available_gpu_mem={available_gb:.2f} GB"
    )


async def _graphs(state: SimState, avail: float, startup_s: float, prefix: str) -> float:
    """CUDA graph capture lines; returns the memory left afterwards."""
    if state.args.disable_cuda_graph:
        return avail
    plan = state.plan
    sizes = capture_batch_sizes(
        state.speculative, plan.cuda_graph_max_bs, plan.max_running_requests
    )
    graph, begin = plan.cuda_graph_gib, time.monotonic()
    before, _ = graph_lines(sim_release(state.version), plan.num_draft_tokens, sizes, avail,
                            graph, 0.0)
    for line in before:
        log(line, prefix)
    await asyncio.sleep(startup_s * GRAPH_SHARE)
    _, after = graph_lines(sim_release(state.version), plan.num_draft_tokens, sizes, avail,
                           graph, time.monotonic() - begin)
    log(after, prefix)
    return avail - graph


async def run_startup(state: SimState, startup_s: float, prefix: str = "") -> None:
    """Print the startup sequence over ``startup_s`` seconds (before the HTTP server exists)."""
    begin = time.monotonic()
    mem = state.plan.memory_gib
    if state.metrics is not None:
        state.metrics.use_release(sim_release(state.version).metric_is_streaming)
    for line in warnings(state):
        log(line, prefix)
    free = state.plan.free_before_weights_gib  # SGLang's `pre`: the GPU less the CUDA context
    log(f"Load weight begin. avail mem={free:.2f} GB", prefix)
    await asyncio.sleep(startup_s * LOAD_SHARE)
    avail = free - mem["weights"]
    log(
        f"Load weight end. elapsed={time.monotonic() - begin:.2f} s, "
        f"type={state.shape.architecture}, avail mem={avail:.2f} GB, "
        f"mem usage={mem['weights']:.2f} GB.",
        prefix,
    )
    await asyncio.sleep(startup_s * POOL_SHARE)
    for line in pool_lines(state, sim_release(state.version)):
        log(line, prefix)
    avail -= mem["mamba"] + mem["mamba_intermediate"] + mem["kv"]
    log(f"Memory pool end. avail mem={avail:.2f} GB", prefix)
    avail = await _graphs(state, avail, startup_s, prefix)
    log(scheduler_line(state, avail), prefix)
    if state.metrics is not None:
        state.metrics.set(startup_available_gpu_memory_gb=avail)
    await asyncio.sleep(max(0.0, begin + startup_s - time.monotonic()))
