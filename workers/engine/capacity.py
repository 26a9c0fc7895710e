"""SGLang's memory pools and running cap, as pure functions of a model's shape and release.

The shape comes from the model's own config.json (:mod:`workers.engine.model_config`), the flag
resolution from :mod:`workers.engine.server_args`; this module is
``model_executor/model_runner_kv_cache_mixin.py`` and ``pool_configurator.py``:

1. ``pre``: free GPU memory when the weights start loading (``init_torch_distributed`` returns
   ``get_available_gpu_memory``; the log prints it as ``Load weight begin. avail mem=``). Read
   from the engine's log when there is one; otherwise the GPU's total less
   :data:`STARTUP_USED_GIB`, what the CUDA context and NCCL took before it on the H200.
2. ``post = pre - weights`` (``Load weight end … mem usage=``; for MoE models also less the
   expert-location maps built before the weights), then
   ``rest = post - pre * (1 - mem_fraction_static)`` (``_profile_available_bytes``).
3. Hybrid models: ``handle_max_mamba_cache`` reserves the speculative intermediate states for
   the pre-cap ``max_running_requests`` and the Mamba slots.
4. ``max_total_num_tokens = int(rest * 2**30) // cell // page * page``
   (``DefaultPoolConfigurator``; the SWA split of ``HybridSWAPoolConfigurator``), capped by
   ``--max-total-tokens``; the cap by ``_resolve_max_num_reqs``.

Written from 0.5.11; the release in ``EngineFlags.sglang_version`` picks, per step, the
arithmetic its wheel has (:mod:`workers.engine.releases`; each branch below names the release
and function it was read from). Checked against real SGLang 0.5.11 on one H200
(tests/test_real_pools.py; the other releases only from their source): the caps exactly, the
KV tokens within 0.08 % from the config alone and within 0.05 % from the logged ``avail mem``,
for eight launches (dense, hybrid, MoE hybrid, fp8 KV) and one refusal.
Not modelled: DP attention, pipeline parallelism; tensor parallelism splits weights, KV heads
(replicated below one per GPU) and Mamba state evenly.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.admission import (  # noqa: F401  (re-exported for callers)
    CLIP_MAX_NEW_TOKENS,
    NewTokenRatio,
    admission_tokens,
    steady_kv_per_request,
)
from workers.engine.launch_refusals import check_hybrid_flags, check_launch  # noqa: F401
from workers.engine.mamba_pool import (  # noqa: F401  (re-exported for callers)
    conv_bytes_per_slot,
    conv_window_share,
    handle_max_mamba_cache,
    mamba_bytes_per_slot,
    ssm_bytes_per_slot,
)
from workers.engine.mem_reserve import decode_graph_reserve_mib, tokenizer_gpu_mib
from workers.engine.model_config import ModelConfigError, ModelShape, model_shape  # noqa: F401
from workers.engine.server_args import (  # noqa: F401  (re-exported for callers)
    DEFAULT_MAX_PREFILL_TOKENS,
    EAGLE_FAMILY,
    MIB_PER_GIB,
    SPECULATIVE_DEFAULT_MAX_RUNNING,
    EngineFlags,
    cli_max_running_requests,
    derived_defaults,
    mamba_ratio,
    num_draft_tokens,
    overlap_schedule,
    parse_human_int,
    release,
    reserved_mib,
    resolved_mamba_strategy,
    speculative,
    speculative_params,
    vlm_mem_factor,
)

GIB = 1024**3
# Used GPU memory when SGLang measures ``pre`` (step 1), measured on one H200 (143,771 MiB,
# driver 580.159, torch 2.11+cu130): ``Load weight begin. avail mem=139.13 GB`` in all four
# 0.5.11 captures, dense and hybrid alike. The CUDA context plus the NCCL communicators
# (``Init torch distributed ends. mem usage=0.09 GB``); a property of the driver and runtime,
# not of SGLang's code, so a live engine's logged value replaces it.
STARTUP_USED_GIB = 143_771 / 1024 - 139.13
# Element size of --kv-cache-dtype ("auto": the model's dtype).
KV_DTYPE_BYTES = {"fp8_e5m2": 1, "fp8_e4m3": 1, "fp4_e2m1": 0.5, "bfloat16": 2, "bf16": 2,
                  "float16": 2}
# --swa-full-tokens-ratio default (server_args.py).
SWA_FULL_TOKENS_RATIO = 0.8
NOT_ENOUGH = "Not enough memory. Please try to increase --mem-fraction-static."


def kv_dtype_scale(shape: ModelShape, flags: EngineFlags) -> float:
    """KV element size of ``--kv-cache-dtype`` over the model dtype's (1 for ``auto``)."""
    return KV_DTYPE_BYTES.get(flags.kv_cache_dtype, shape.dtype_bytes) / shape.dtype_bytes


def _kv_split(shape: ModelShape, tp: int) -> float:
    """The TP divisor of the KV cell: ``max(1, kv_heads // tp)`` heads per GPU
    (``get_num_kv_heads``); the MLA latent (kv_heads 0) is whole on every GPU."""
    if shape.kv_heads <= 0:
        return 1.0
    return shape.kv_heads / max(1, shape.kv_heads // tp)


def kv_cell_bytes(shape: ModelShape, flags: EngineFlags) -> float:
    """KV bytes per token per GPU, full-attention layers (``_compute_cell_size``)."""
    return shape.kv_bytes_per_token * kv_dtype_scale(shape, flags) / _kv_split(shape, flags.tp_size)


def swa_cell_bytes(shape: ModelShape, flags: EngineFlags) -> float:
    """Sliding-window KV bytes per token per GPU (its pool holds 0.8 x the full pool's tokens)."""
    scale = kv_dtype_scale(shape, flags) / _kv_split(shape, flags.tp_size)
    return shape.swa_kv_bytes_per_token * scale


def resolve_max_num_reqs(
    max_total_tokens: int, context_len: int, cli_cap: int | None, slots: int, ratio: int | None,
    rule: str = "min_estimated",
) -> int:
    """Effective running cap (``model_runner_kv_cache_mixin.py::_resolve_max_num_reqs``).

    ``rule`` is the release's ``explicit_cap_rule``: an explicit cap is limited to
    ``clamp(tokens / context_len * 512, 2048, 4096)`` through 0.5.13 (``min_estimated``) and
    to ``tokens // 2`` from 0.5.14 (``min_half_tokens``; ``kv_cache_configurator.py::
    resolve_max_num_reqs`` from 0.5.16).
    """
    estimated = min(max(int(max_total_tokens / context_len * 512), 2048), 4096)
    if cli_cap is not None and rule == "min_half_tokens":
        cap = min(cli_cap, max_total_tokens // 2)
    elif cli_cap is not None:
        cap = min(cli_cap, estimated)
    else:
        cap = min(estimated, max_total_tokens // 2)
    if ratio is not None:
        cap = min(cap, slots // ratio)
    return cap


@dataclass(frozen=True)
class CapacityPlan:
    """What SGLang would allocate and the caps its scheduler would apply."""

    max_running_requests: int  # effective cap the scheduler applies
    cli_max_running_requests: int | None  # /server_info top level: CLI value, or 48 with spec
    max_total_num_tokens: int
    max_mamba_cache_size: int
    mamba_ratio: int
    mem_fraction_static: float
    context_len: int
    max_req_len: int
    chunked_prefill_size: int
    cuda_graph_max_bs: int
    # keys: total, weights, mamba, mamba_intermediate, kv, unexplained, draft, reserved, free
    # (they sum to total). "free" is pool memory nothing allocates: mostly the speculative
    # reservation made for the pre-cap max_running_requests but allocated only for the final
    # cap; "reserved" holds the CUDA context and the activations' share.
    memory_gib: dict[str, float]
    max_req_input_len: int = 0
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    overlap_schedule: bool = True
    num_draft_tokens: int = 0
    # Graph memory: SGLang's own allowance in the reserve formula, bs * 2 MiB (not measured).
    cuda_graph_gib: float = 0.0
    # Step 1's ``pre``: what ``Load weight begin. avail mem=`` prints.
    free_before_weights_gib: float = 0.0
    # The SGLang release whose arithmetic sized this plan.
    sglang_version: str = ""


def draft_loaded_gib(shape: ModelShape, flags: EngineFlags) -> float:
    """GiB of draft weights resident when a release that loads the draft first
    (``draft_before_pools``) sizes the target's pools; 0 otherwise."""
    if not (speculative(flags) and release(flags).draft_before_pools):
        return 0.0
    return max(shape.draft_load_gib, shape.draft_weights_gib) / flags.tp_size


def draft_gib(shape: ModelShape, flags: EngineFlags, tokens: int) -> tuple[float, float]:
    """(kept, peak) GiB of the speculative draft: its weights that stay plus its KV pool of
    ``tokens`` (one attention layer), and the same while it loads with its own embeddings.
    The draft worker starts after the target's pools and graphs, out of what is left; from
    0.5.17 its weights are already in (:func:`draft_loaded_gib`) and only its KV pool comes
    after."""
    if not speculative(flags):
        return 0.0, 0.0
    kv = tokens * shape.draft_kv_bytes_per_token * kv_dtype_scale(shape, flags)
    kv /= _kv_split(shape, flags.tp_size) * GIB
    loaded = draft_loaded_gib(shape, flags)
    if loaded:
        return loaded + kv, kv
    kept = shape.draft_weights_gib / flags.tp_size + kv
    return kept, max(shape.draft_load_gib, shape.draft_weights_gib) / flags.tp_size + kv


def _kv_tokens(available_bytes: int, shape: ModelShape, flags: EngineFlags) -> int:
    """``calculate_pool_sizes`` and ``_apply_token_constraints``: tokens, page-aligned."""
    cell = kv_cell_bytes(shape, flags)
    if shape.swa_layers:
        cell += SWA_FULL_TOKENS_RATIO * swa_cell_bytes(shape, flags)
        tokens = int(available_bytes // cell)
    else:
        tokens = available_bytes // int(cell)
    if flags.max_total_tokens is not None:
        tokens = min(tokens, flags.max_total_tokens)
    tokens = tokens // flags.page_size * flags.page_size
    if tokens <= 0:
        raise RuntimeError(NOT_ENOUGH)
    return tokens


def _memory_map(
    shape: ModelShape, flags: EngineFlags, total_gib: float, pre: float,
    sizes: tuple[int, int, int, float],
) -> dict[str, float]:
    """Split the GPU into weights, Mamba, intermediate, KV, draft, reserved and free GiB."""
    slots, cap, tokens, fraction = sizes
    weights = shape.weights_gib / flags.tp_size
    per_slot = mamba_bytes_per_slot(shape, flags) if shape.hybrid else 0.0
    mamba = (slots + 1) * per_slot / GIB if shape.hybrid else 0.0  # MambaPool holds slots + 1
    inter = 0.0
    if shape.hybrid:  # the conv window as allocated (mamba_pool.conv_window_share)
        inter_slot = per_slot - conv_bytes_per_slot(shape, flags) * (
            1 - conv_window_share(shape, flags))
        inter = (cap + 1) * num_draft_tokens(flags) * inter_slot / GIB
    kv = tokens * (kv_cell_bytes(shape, flags)
                   + SWA_FULL_TOKENS_RATIO * swa_cell_bytes(shape, flags)) / GIB
    unexplained = shape.unexplained_gib / flags.tp_size
    draft = draft_gib(shape, flags, tokens)[0]
    pool = pre * fraction  # what post - pre * (1 - f) leaves besides the weights
    first = draft_loaded_gib(shape, flags)  # in the pool when it loads before the pools
    free = max(0.0, pool - shape.pre_load_gib - weights - mamba - inter - kv - unexplained
               - first)
    used = weights + mamba + inter + kv + unexplained + draft + free
    return {"total": total_gib, "weights": weights, "mamba": mamba, "mamba_intermediate": inter,
            "kv": kv, "unexplained": unexplained, "draft": draft,
            "reserved": total_gib - used, "free": free}


def _check_draft_fits(
    shape: ModelShape, flags: EngineFlags, left_gib: float, graph_gib: float, tokens: int
) -> None:
    """The draft loads and allocates its KV pool in what the target left: CUDA runs out when
    its peak does not fit (``EAGLEWorker`` → ``ModelRunner`` for the draft, after the target's
    CUDA graphs, which take about ``graph_gib``)."""
    peak = draft_gib(shape, flags, tokens)[1]
    if peak > 0 and peak > left_gib - graph_gib:
        raise RuntimeError(
            f"CUDA out of memory: the speculative draft needs {peak:.2f} GiB (weights while "
            f"loading + its KV pool of {tokens} tokens), {left_gib - graph_gib:.2f} GiB left "
            "after the target's pools and CUDA graphs."
        )


def plan_capacity(
    shape: ModelShape, flags: EngineFlags, gpu_memory_mib: int,
    free_before_weights_gib: float | None = None,
) -> CapacityPlan:
    """Size the pools and the running cap as SGLang would (``_resolve_memory_pool_config``).

    ``free_before_weights_gib`` is the engine's logged ``Load weight begin. avail mem=``; when
    None, the GPU's total less :data:`STARTUP_USED_GIB`.
    """
    if shape.hybrid:
        check_hybrid_flags(flags)
    check_launch(shape, flags)
    chunk, graph_bs, fraction = derived_defaults(gpu_memory_mib, flags, shape)
    total_gib = gpu_memory_mib / MIB_PER_GIB
    found = release(flags)
    pre = free_before_weights_gib
    if pre is None:
        tokenizer = tokenizer_gpu_mib(flags, shape, found.mm_ipc_pool_mib) / MIB_PER_GIB
        pre = max(0.0, total_gib - STARTUP_USED_GIB - tokenizer)
    post = pre - shape.pre_load_gib - (shape.weights_gib + shape.unexplained_gib) / flags.tp_size
    # 0.5.17 Scheduler.init_memory_pools runs after the draft worker loaded its weights, and
    # KVCacheConfigurator._profile_available_bytes reads free memory then ("draft weights are
    # now counted"): the draft as loaded, its own embed and lm_head included.
    post -= draft_loaded_gib(shape, flags)
    rest = post - pre * (1 - fraction)
    if shape.multimodal and found.mm_kv_reserve_mib:
        # 0.5.18 kv_cache_configurator.py::mm_runtime_reservation_gb (SGLANG_VLM_CACHE_SIZE_MB).
        rest -= found.mm_kv_reserve_mib / MIB_PER_GIB
    cli_cap = cli_max_running_requests(flags)
    slots, ratio = 0, None
    if shape.hybrid:
        per_slot = mamba_bytes_per_slot(shape, flags)
        rest, slots = handle_max_mamba_cache(rest, per_slot, flags, cli_cap)
        ratio = mamba_ratio(flags)
        if slots <= 0:
            raise RuntimeError(NOT_ENOUGH)
    tokens = _kv_tokens(int(rest * GIB), shape, flags)
    context_len = flags.context_length or shape.context_length
    cap = resolve_max_num_reqs(tokens, context_len, cli_cap, slots, ratio,
                               found.explicit_cap_rule)
    if cap <= 0:
        raise RuntimeError(f"max_running_requests resolves to {cap} (Mamba slots {slots} < R).")
    memory = _memory_map(shape, flags, total_gib, pre, (slots, cap, tokens, fraction))
    allocated = shape.pre_load_gib + draft_loaded_gib(shape, flags) + sum(memory[k] for k in (
        "weights", "mamba", "mamba_intermediate", "kv", "unexplained"))
    graph_gib = decode_graph_reserve_mib(flags, graph_bs,
                                         found.graph_reserve_by_phase) / MIB_PER_GIB
    _check_draft_fits(shape, flags, pre - allocated, graph_gib, tokens)
    max_req_len = min(context_len - 1, tokens - 1)
    return CapacityPlan(
        max_running_requests=cap,
        cli_max_running_requests=cli_cap,
        max_total_num_tokens=tokens,
        max_mamba_cache_size=slots,
        mamba_ratio=ratio or 0,
        mem_fraction_static=fraction,
        context_len=context_len,
        max_req_len=max_req_len,
        chunked_prefill_size=chunk,
        cuda_graph_max_bs=graph_bs,
        memory_gib=memory,
        max_req_input_len=max_req_len - 5,
        max_prefill_tokens=flags.max_prefill_tokens,
        overlap_schedule=overlap_schedule(flags, shape.hybrid),
        num_draft_tokens=num_draft_tokens(flags),
        cuda_graph_gib=graph_gib,
        free_before_weights_gib=pre,
        sglang_version=flags.sglang_version,
    )


def mamba_breakdown_gib(
    shape: ModelShape, flags: EngineFlags, plan: CapacityPlan
) -> dict[str, float]:
    """GiB of each MambaPool buffer, as the ``Mamba Cache is allocated`` log line reports them."""
    states = plan.max_mamba_cache_size + 1
    inter = (plan.max_running_requests + 1) * plan.num_draft_tokens
    conv, ssm = conv_bytes_per_slot(shape, flags), ssm_bytes_per_slot(shape, flags)
    return {
        "conv_state": states * conv / GIB,
        "ssm_state": states * ssm / GIB,
        "intermediate_ssm_state_cache": inter * ssm / GIB,
        "intermediate_conv_window_cache": inter * conv * conv_window_share(shape, flags) / GIB,
    }
