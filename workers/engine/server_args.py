"""SGLang's launch flags that decide capacity, and how ``ServerArgs`` resolves them.

Each function names the ``srt/server_args.py`` code it mirrors: the memory reserve and
``mem_fraction_static`` (``_handle_gpu_memory_settings``, ``adjust_mem_fraction_for_vlm``), the
prefill CUDA graph switch (:mod:`workers.engine.mem_reserve`), the speculative defaults
(``_handle_speculative_decoding``) and the Mamba scheduler rules (``_handle_mamba_radix_cache``).
Written from 0.5.11; where a later release resolves a flag differently the branch reads that
release's trait (:func:`release`, :mod:`workers.engine.releases`) and names where it was read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.engine.engine_flags import (  # noqa: F401  (re-exported for callers)
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_SGLANG_VERSION,
    FLAG_ALIASES,
    EngineFlags,
    parse_human_int,
    release_traits,
)
from workers.engine.mem_reserve import (  # noqa: F401  (vlm_mem_factor: re-exported)
    breakable_prefill_graphs,
    decode_graph_reserve_mib,
    piecewise_prefill_graphs,
    piecewise_token_sizes,
    vlm_mem_factor,
)
from workers.engine.releases import Traits

if TYPE_CHECKING:
    from workers.engine.model_config import ModelShape

MIB_PER_GIB = 1024
# Default running cap with speculative decoding (server_args.py::_handle_speculative_decoding).
SPECULATIVE_DEFAULT_MAX_RUNNING = 48
EAGLE_FAMILY = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE"})
# Algorithms that always turn the overlap scheduler off (server_args.py).
NO_OVERLAP_ALGORITHMS = frozenset({"NGRAM", "DFLASH"})
# Extra reserve in MiB per speculative algorithm (server_args.py::_handle_gpu_memory_settings).
SPECULATIVE_RESERVE_MIB = {"EAGLE": 4096, "EAGLE3": 4096, "NEXTN": 4096, "STANDALONE": 6144}
# Architectures whose ``auto`` Mamba strategy may become extra_buffer from 0.5.14 (with the
# default triton linear-attention backend): server_args.py::_support_mamba_cache_extra_buffer.
EXTRA_BUFFER_ARCHITECTURES = frozenset({
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "Qwen3NextForCausalLM", "InternS2PreviewForConditionalGeneration",
    "MiniCPMV4_6ForConditionalGeneration", "BailingMoeV2_5ForCausalLM", "FalconH1ForCausalLM",
    "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM",
})


def release(flags: EngineFlags) -> Traits:
    """The pool-arithmetic traits of the release ``flags`` are planned for."""
    return release_traits(flags.sglang_version)


def speculative(flags: EngineFlags) -> bool:
    """Whether a speculative algorithm is configured."""
    return flags.speculative_algorithm is not None


def reserved_tokens(flags: EngineFlags) -> int:
    """``TokenizerManager.num_reserved_tokens``: EAGLE-family speculative decoding stores the
    draft tokens in the output slots, so ``max(topk * steps, draft_tokens)`` are reserved."""
    if flags.speculative_algorithm not in EAGLE_FAMILY:
        return 0
    steps, topk, drafts = speculative_params(flags)
    return max(topk * steps, drafts)


def speculative_params(flags: EngineFlags) -> tuple[int, int, int]:
    """(steps, topk, draft tokens), as ``auto_choose_speculative_params`` resolves them.

    Defaults are (3, 1, 4) for most architectures; ``topk == 1`` forces ``draft = steps + 1``.
    """
    draft = flags.speculative_num_draft_tokens
    steps = flags.speculative_num_steps or (draft - 1 if draft else 3)
    topk = flags.speculative_eagle_topk or 1
    if topk == 1:
        return steps, topk, steps + 1
    return steps, topk, draft or 4


def num_draft_tokens(flags: EngineFlags) -> int:
    """Draft tokens verified per step (0 without speculative decoding)."""
    return speculative_params(flags)[2] if speculative(flags) else 0


def cli_max_running_requests(flags: EngineFlags) -> int | None:
    """Pre-cap value: the CLI one, or 48 with speculative decoding (server_args.py)."""
    if flags.max_running_requests is None and speculative(flags):
        return SPECULATIVE_DEFAULT_MAX_RUNNING
    return flags.max_running_requests


def resolved_mamba_strategy(flags: EngineFlags, architecture: str | None = None) -> str:
    """What ``auto`` resolves to on a hybrid model (``_handle_mamba_radix_cache``).

    Through 0.5.13 ``no_buffer``. From 0.5.14 (``server_args.py::_handle_mamba_radix_cache``;
    ``arg_groups/overrides.py`` from 0.5.17) ``extra_buffer`` when the overlap scheduler is
    wanted or ``page_size > 1`` and the architecture supports it (``architecture`` None: one
    that does, as every hybrid :mod:`workers.engine.model_config` reads), else ``no_buffer``.
    """
    strategy = flags.mamba_scheduler_strategy
    if strategy != "auto":
        return strategy
    if release(flags).mamba_auto_strategy != "extra_buffer_if_overlap":
        return "no_buffer"
    # Before the speculative rules run (_handle_model_specific_adjustments comes first in
    # __post_init__), so only --disable-overlap-schedule itself counts, not NGRAM's switch.
    wants = not flags.disable_overlap_schedule or flags.page_size > 1
    supported = architecture is None or architecture in EXTRA_BUFFER_ARCHITECTURES
    return "extra_buffer" if wants and supported else "no_buffer"


def overlap_schedule(flags: EngineFlags, hybrid: bool = True) -> bool:
    """Whether the overlap scheduler stays on (``server_args.py``
    ``disable_overlap_schedule`` rules; docs/capacity.md step 8)."""
    algo = flags.speculative_algorithm
    if flags.disable_overlap_schedule or algo in NO_OVERLAP_ALGORITHMS:
        return False
    if algo in EAGLE_FAMILY:
        topk = speculative_params(flags)[1]
        return (flags.enable_spec_v2 or not release(flags).spec_v2_env) and topk == 1
    # Radix cache + no_buffer (non-speculative) forces overlap off on hybrid models.
    no_buffer = resolved_mamba_strategy(flags) == "no_buffer"
    return not (hybrid and not flags.disable_radix_cache and no_buffer)


def mamba_ratio(flags: EngineFlags) -> int:
    """Mamba slots per running request (``model_runner_kv_cache_mixin.py::_calculate_mamba_ratio``,
    ``mem_cache/kv_cache_configurator.py`` from 0.5.16).

    1 without radix cache, 3 with ``no_buffer``, 5 with ``extra_buffer`` and overlap on (two
    ping-pong slots), 4 with ``extra_buffer`` and overlap off. From 0.5.13 ``extra_buffer_lazy``
    keeps one ping-pong slot (4; ``MAMBA_CACHE_V2_ADDITIONAL_RATIO_OVERLAP_LAZY``). From 0.5.17
    ``SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK`` drops the base 3 by one (``no_buffer`` adds it back).
    """
    if flags.disable_radix_cache:
        return 1
    found = release(flags)
    skip = found.skip_decode_lock_env and flags.mamba_skip_decode_lock
    base = 3 - (1 if skip else 0)
    strategy = resolved_mamba_strategy(flags)
    if strategy == "extra_buffer_lazy" and found.lazy_extra_buffer:
        return base + 1
    if strategy not in ("extra_buffer", "extra_buffer_lazy"):
        return base + (1 if skip else 0)
    return base + (2 if overlap_schedule(flags) else 1)


def _gpu_memory_row(
    gpu_memory_mib: int, tp_size: int, small: tuple[int, int, int] = (2048, 24, 80)
) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs) by GPU memory (the table of
    ``server_args.py::_handle_gpu_memory_settings``; docs/capacity.md step 1). ``small`` is the
    release's 20-35 GiB row (0.5.20 ``arg_groups/memory_hook.py``: 4096, 48, 160)."""
    if gpu_memory_mib <= 0:
        return 4096, 160
    gib = gpu_memory_mib / MIB_PER_GIB
    rows = ((20, 2048, 8, 8), (35, *small), (60, 4096, 32, 160), (160, 8192, 256, 512))
    for limit, chunk, graph_small_tp, graph_big_tp in rows:
        if gib < limit:
            return chunk, graph_small_tp if tp_size < 4 else graph_big_tp
    return 16384, 512


def piecewise_cuda_graph(flags: EngineFlags, shape: ModelShape | None) -> bool:
    """Whether prefill CUDA graphs are captured, by the release's ``prefill_graph_rule``
    (:mod:`workers.engine.mem_reserve`)."""
    if release(flags).prefill_graph_rule == "breakable":
        return breakable_prefill_graphs(flags, shape)
    return piecewise_prefill_graphs(flags, shape)


def reserved_mib(
    chunked_prefill_size: int,
    cuda_graph_max_bs: int,
    flags: EngineFlags,
    gpu_mib: int,
    shape: ModelShape | None = None,
) -> float:
    """Memory kept out of the static pool (``server_args.py::_handle_gpu_memory_settings``)."""
    prefill = chunked_prefill_size if chunked_prefill_size > 0 else flags.max_prefill_tokens
    reserved = 512 + max(prefill, 2048) * 1.5 + decode_graph_reserve_mib(
        flags, cuda_graph_max_bs, release(flags).graph_reserve_by_phase)
    reserved += flags.tp_size / 8 * 1024  # tp * pp / 8 * 1024 with pp = 1
    if piecewise_cuda_graph(flags, shape):
        if shape is not None and shape.mla:
            # use_mla_backend(): "the memory overhead is much higher than expected", a flat
            # 1.5 GiB, whatever the captured sizes (max tokens 2048 by default for MLA).
            reserved += 1.5 * 1024
        else:
            max_tokens = flags.piecewise_cuda_graph_max_tokens or chunked_prefill_size
            if flags.max_total_tokens is not None:
                max_tokens = min(max_tokens, flags.max_total_tokens)
            reserved += len(piecewise_token_sizes(max_tokens)) * 8
    if gpu_mib > 60 * MIB_PER_GIB:
        reserved = max(reserved, 10240)
    if not release(flags).mem_fraction_spec_reserve_mib:
        return reserved  # 0.5.14 _handle_gpu_memory_settings: no draft reserve
    return reserved + SPECULATIVE_RESERVE_MIB.get(flags.speculative_algorithm or "", 0)


def derived_defaults(
    gpu_memory_mib: int, flags: EngineFlags, shape: ModelShape | None = None
) -> tuple[int, int, float]:
    """(chunked_prefill_size, cuda_graph_max_bs, mem_fraction_static), as derived by SGLang.

    Explicit flags win. The VLM factor applies when the fraction is derived and the model is
    one of SGLang's multimodal architectures with a ``vision_config``.
    """
    small = release(flags).small_gpu_defaults
    chunk_default, graph_default = _gpu_memory_row(gpu_memory_mib, flags.tp_size, small)
    chunk = flags.chunked_prefill_size or chunk_default
    graph_bs = flags.cuda_graph_max_bs or graph_default
    if flags.mem_fraction_static is not None:
        return chunk, graph_bs, flags.mem_fraction_static
    if gpu_memory_mib <= 0:
        fraction = 0.88
    else:
        reserved = reserved_mib(chunk, graph_bs, flags, gpu_memory_mib, shape)
        fraction = round((gpu_memory_mib - reserved) / gpu_memory_mib, 3)
    if shape is not None and shape.multimodal:
        fraction *= vlm_mem_factor(shape.vision)
    return chunk, graph_bs, fraction
