"""What each SGLang release from 0.5.10.post1 to 0.5.23 does differently, read from its wheel.

Every release's published wheel (``pip download sglang==X --no-deps``) was unpacked and the
files below were diffed release to release; paths are under ``python/sglang/srt/``. A trait is
declared once with its value in 0.5.10.post1 and changes only where a :data:`CHANGES` entry
says so, each entry naming the file (and function) it was read from. ``traits(version)`` folds
the changes up to ``version``; a release newer than :data:`NEWEST` gets the newest traits and
:func:`unknown_traits` names the ones that then rest on an assumption.

How :mod:`workers.engine.capacity` uses the arithmetic traits (names as in :class:`Traits`):

- ``explicit_cap_rule``: ``"min_estimated"`` caps an explicit ``--max-running-requests`` at
  ``estimated = clamp(tokens / context_len * 512, 2048, 4096)``; ``"min_half_tokens"`` caps it
  at ``max_total_num_tokens // 2`` (``resolve_max_num_reqs``), as the unset cap always was.
- ``mamba_auto_strategy``: what ``--mamba-*-strategy auto`` resolves to on a hybrid model:
  ``"no_buffer"`` (and the overlap scheduler off) or ``"extra_buffer_if_overlap"`` (extra_buffer
  whenever overlap is on or page_size > 1 and the model supports it).
- ``spec_v2_default`` / ``spec_v2_env``: the default of ``SGLANG_ENABLE_SPEC_V2`` and whether
  the variable is read at all (from 0.5.14 speculative decoding always runs the V2 worker).
- ``spec_reservation``: the speculative intermediate Mamba states reserved before the KV pool:
  ``"cli_cap"`` (``per_slot * cli_cap * D``), ``"capped"`` (``per_slot * min(cli_cap, slots //
  R) * D``, and an automatic Mamba budget split as ``budget // (per_slot * (1 + D / R))``) or
  ``"capped_plus_one"`` (the same for ``capped + 1`` requests, budget less ``per_slot * (1 +
  D)`` first).
- ``mamba_pool_padding``: the Mamba pool's extra slot is deducted from the budget (``slots =
  (budget - per_slot) // per_slot``, memory ``(slots + 1) * per_slot``).
- ``lazy_extra_buffer``: ``extra_buffer_lazy`` exists (R = 3 + 1 with overlap).
- ``mm_kv_reserve_mib``: taken from the KV budget of a multimodal model before sizing
  (``SGLANG_VLM_CACHE_SIZE_MB``).
- ``mem_fraction_spec_reserve_mib``: added to ``reserved_mem`` of an unset
  ``--mem-fraction-static`` with EAGLE/MTP (``_handle_gpu_memory_settings``; 0 from 0.5.14);
  ``small_gpu_defaults``: (chunked_prefill_size, cuda_graph_max_bs at tp < 4, at tp >= 4) on a
  GPU of 20-35 GiB.
- ``skip_decode_lock_env``: ``SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1`` (default off) lowers R by
  one (extra_buffer 5 -> 4, lazy 4 -> 3; no_buffer stays 3: base 2 plus one).
- ``draft_before_pools``: the speculative draft's weights load before the target's pools are
  sized, so the KV budget pays for them; ``prefill_graph_rule``: which prefill CUDA graphs a
  model keeps (``"piecewise"``: off for multimodal and the listed architectures; ``"breakable"``:
  per backend, :mod:`workers.engine.mem_reserve`); ``mm_ipc_pool_mib``: the tokenizer's CUDA-IPC
  feature pool a multimodal model gets on GPU 0 before ``pre`` is measured;
  ``graph_reserve_by_phase``: the reserve counts a phase's graphs only while that phase
  captures them, so ``--disable-cuda-graph`` (both phases off) drops the decode term
  ``cuda_graph_max_bs * 2`` that earlier releases always added.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

# Every release in the range, oldest first (PyPI's list for sglang, 0.5.10.post1 … 0.5.23).
KNOWN: tuple[str, ...] = (
    "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14",
    "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21",
    "0.5.22", "0.5.23",
)
OLDEST, NEWEST = KNOWN[0], KNOWN[-1]
# Flags 0.5.20 no longer accepts (their deprecated aliases in server_args.py::add_cli_args of
# 0.5.14-0.5.19 are gone; arg_groups/fields/exec_.py) and what replaced them.
RENAMED_0_5_20 = {
    "mamba-scheduler-strategy": "mamba-radix-cache-strategy",
    "cuda-graph-max-bs": "cuda-graph-max-bs-decode",
    "disable-piecewise-cuda-graph": "cuda-graph-backend-prefill=disabled",
    "enforce-piecewise-cuda-graph": "cuda-graph-backend-prefill=tc_piecewise",
    "piecewise-cuda-graph-max-tokens": "cuda-graph-max-bs-prefill",
}


@dataclass(frozen=True)
class Traits:
    """One release's formats and arithmetic (defaults: 0.5.10.post1's)."""

    version: str = OLDEST
    # --- log lines -------------------------------------------------------------------------
    kv_line_dtype: bool = False  # "KV Cache is allocated. dtype: torch.bfloat16, #tokens: …"
    kv_line_label: bool = False  # hybrid SWA pools print "Full KV Cache …" / "SWA KV Cache …"
    graph_line: str = "legacy"  # "legacy" | "named" | "named_bs_end"
    graph_bs_line: bool = True  # "Capture cuda graph bs [1, 2, …]"
    prefill_pending_token: bool = False  # "#pending-token: N, " in the Prefill batch line
    overlap_off_line: bool = True  # "Disabling overlap schedule since mamba no_buffer …"
    batch_lines_file: str = "observability/scheduler_metrics_mixin.py"
    # --- metrics ---------------------------------------------------------------------------
    metric_context_len: bool = False  # sglang:context_len gauge
    metric_is_streaming: bool = False  # is_streaming label on the request counters
    # --- /server_info, /v1/loads -------------------------------------------------------------
    memory_usage_graph: str = "float"  # internal_states[].memory_usage.graph: "float" | "by_phase"
    server_info_startup_time: bool = False
    loads_aggregate: bool = True  # "dp_rank_count", "aggregate", loads[].num_total_reqs
    loads_accelerator: bool = False  # "accelerator", "num_accelerators"
    # --- /v1/chat/completions ---------------------------------------------------------------
    # The choice key that holds the sampled token ids when the request sets return_token_ids
    # (None: the request field does not exist and is ignored, as any unknown key).
    chat_token_ids_key: str | None = None
    # --- pool arithmetic (see the module docstring) ---------------------------------------
    kv_configurator: str = "model_executor/model_runner_kv_cache_mixin.py"
    spec_v2_default: bool = False
    spec_v2_env: bool = True
    explicit_cap_rule: str = "min_estimated"
    mamba_auto_strategy: str = "no_buffer"
    spec_reservation: str = "cli_cap"
    mamba_pool_padding: bool = False
    lazy_extra_buffer: bool = False
    mm_kv_reserve_mib: int = 0
    draft_before_pools: bool = False
    prefill_graph_rule: str = "piecewise"  # "piecewise" | "breakable"
    graph_reserve_by_phase: bool = False  # no decode-graph reserve under --disable-cuda-graph
    mm_ipc_pool_mib: int = 0
    conv_window_dedup: bool = False  # one D + K - 2 conv window per request (log line only)
    skip_decode_lock_env: bool = False  # SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1 lowers R by 1
    # An unset --mem-fraction-static reserves this much more with EAGLE/MTP (6 GiB STANDALONE).
    mem_fraction_spec_reserve_mib: int = 4096
    # Defaults on a 20-35 GiB GPU: chunked prefill, graph max bs at tp < 4 and at tp >= 4.
    small_gpu_defaults: tuple[int, int, int] = (2048, 24, 80)
    # --- flags -----------------------------------------------------------------------------
    mamba_strategy_flag: str = "mamba-scheduler-strategy"
    removed_flags: dict[str, str] = field(default_factory=dict)
    # The wheel's METADATA Requires-Dist pins that decide whether it runs on a machine.
    pins: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Change:
    """A trait's new value from release ``since`` on, and where in that wheel it was read."""

    since: str
    trait: str
    value: Any
    source: str


CHANGES: tuple[Change, ...] = (
    Change("0.5.11", "prefill_pending_token", True,
           "observability/scheduler_metrics_mixin.py::report_prefill_stats"),
    Change("0.5.11", "metric_context_len", True, "observability/metrics_collector.py"),
    Change("0.5.11", "spec_v2_default", True, "environ.py (SGLANG_ENABLE_SPEC_V2)"),
    Change("0.5.13", "kv_line_dtype", True,
           "mem_cache/memory_pool.py::MHATokenToKVPool._create_buffers"),
    Change("0.5.13", "batch_lines_file", "managers/scheduler_components/metrics_reporter.py",
           "managers/scheduler_components/metrics_reporter.py::report_prefill_stats"),
    Change("0.5.13", "loads_aggregate", False,
           "entrypoints/v1_loads.py::get_loads, managers/load_snapshot.py::LoadSnapshot.to_dict"),
    Change("0.5.13", "spec_reservation", "capped",
           "model_executor/model_runner_kv_cache_mixin.py::handle_max_mamba_cache"),
    Change("0.5.13", "lazy_extra_buffer", True,
           "model_executor/model_runner_kv_cache_mixin.py::_calculate_mamba_ratio"),
    Change("0.5.14", "explicit_cap_rule", "min_half_tokens",
           "model_executor/model_runner_kv_cache_mixin.py::_resolve_max_num_reqs"),
    Change("0.5.14", "mamba_auto_strategy", "extra_buffer_if_overlap",
           "server_args.py::_handle_mamba_radix_cache"),
    Change("0.5.14", "overlap_off_line", False, "server_args.py::_handle_mamba_radix_cache"),
    Change("0.5.14", "spec_v2_env", False, "arg_groups/speculative_hook.py"),
    Change("0.5.14", "graph_line", "named", "model_executor/model_runner.py::init_device_graphs"),
    Change("0.5.14", "graph_bs_line", False, "model_executor/model_runner.py::init_device_graphs"),
    Change("0.5.14", "mem_fraction_spec_reserve_mib", 0,
           "server_args.py::_handle_gpu_memory_settings"),
    Change("0.5.14", "mamba_strategy_flag", "mamba-radix-cache-strategy",
           "server_args.py::add_cli_args"),
    Change("0.5.16", "kv_configurator", "mem_cache/kv_cache_configurator.py",
           "mem_cache/kv_cache_configurator.py::KVCacheConfigurator"),
    Change("0.5.17", "kv_line_label", True,
           "mem_cache/memory_pool.py::KVCache._finalize_allocation_log"),
    Change("0.5.17", "metric_is_streaming", True,
           "observability/metrics_collector.py::TokenizerMetricsCollector"),
    Change("0.5.17", "memory_usage_graph", "by_phase",
           "managers/scheduler_components/memory_usage.py::build_memory_usage"),
    Change("0.5.17", "server_info_startup_time", True, "entrypoints/http_server.py::server_info"),
    Change("0.5.17", "loads_accelerator", True, "entrypoints/v1_loads.py::get_loads"),
    Change("0.5.17", "chat_token_ids_key", "token_ids",
           "entrypoints/openai/serving_chat.py::_build_chat_response (ret_item['output_ids'])"),
    Change("0.5.17", "spec_reservation", "capped_plus_one",
           "mem_cache/kv_cache_configurator.py::_handle_max_mamba_cache"),
    Change("0.5.17", "mamba_pool_padding", True,
           "mem_cache/kv_cache_configurator.py::_handle_max_mamba_cache"),
    Change("0.5.17", "skip_decode_lock_env", True,
           "mem_cache/kv_cache_configurator.py::_calculate_mamba_ratio"),
    Change("0.5.17", "draft_before_pools", True,
           "managers/scheduler.py::Scheduler.init_memory_pools (after the draft worker loads)"),
    Change("0.5.17", "prefill_graph_rule", "breakable",
           "server_args.py::_apply_cuda_graph_compatibility, reserve_for_graph_mb"),
    Change("0.5.17", "graph_reserve_by_phase", True,
           "server_args.py::reserve_for_graph_mb (decode max_bs * 2 only if its backend is on)"),
    Change("0.5.17", "mm_ipc_pool_mib", 1024,
           "server_args.py::_handle_multimodal_feature_transport (SGLANG_MM_FEATURE_CACHE_MB)"),
    Change("0.5.17", "conv_window_dedup", True,
           "mem_cache/memory_pool.py::_allocate_deduplicated_conv_window"),
    Change("0.5.18", "chat_token_ids_key", "response_token_ids",
           "entrypoints/openai/protocol.py::ChatCompletionResponseChoice"),
    Change("0.5.18", "mm_kv_reserve_mib", 100,
           "mem_cache/kv_cache_configurator.py::mm_runtime_reservation_gb"),
    Change("0.5.20", "removed_flags", RENAMED_0_5_20, "arg_groups/fields/exec_.py"),
    Change("0.5.20", "small_gpu_defaults", (4096, 48, 160),
           "arg_groups/memory_hook.py::handle_gpu_memory_settings"),
    Change("0.5.22", "graph_line", "named_bs_end",
           "model_executor/model_runner_components/cuda_graph_setup.py"),
)

# METADATA Requires-Dist of each wheel: torch, sglang-kernel, flashinfer-python, transformers.
_PINS: dict[str, tuple[str, str, str, str]] = {
    "0.5.10.post1": ("2.9.1", "0.4.1", "0.6.7.post3", "5.3.0"),
    "0.5.11": ("2.11.0", "0.4.2", "0.6.8.post1", "5.6.0"),
    "0.5.12": ("2.11.0", "0.4.2.post2", "0.6.11.post1", "5.6.0"),
    "0.5.12.post1": ("2.11.0", "0.4.2.post2", "0.6.11.post1", "5.6.0"),
    "0.5.13": ("2.11.0", "0.4.3", "0.6.12", "5.8.1"),
    "0.5.13.post1": ("2.11.0", "0.4.3", "0.6.12", "5.8.1"),
    "0.5.14": ("2.11.0", "0.4.4", "0.6.12", "5.8.1"),
    "0.5.15": ("2.11.0", "0.4.4", "0.6.12", "5.12.1"),
    "0.5.15.post1": ("2.11.0", "0.4.4", "0.6.12", "5.12.1"),
    "0.5.16": ("2.11.0", "0.4.5", "0.6.14", "5.12.1"),
    "0.5.17": ("2.11.0", "0.4.5", "0.6.15.post1", "5.12.1"),
    "0.5.18": ("2.13.0", "0.4.6.post1", "0.6.17", "5.12.1"),
    "0.5.19": ("2.13.0", "0.4.6.post1", "0.6.18", "5.12.1"),
    "0.5.20": ("2.13.0", "0.4.7", "0.6.18", "5.12.1"),
    "0.5.21": ("2.13.0", "0.4.7", "0.6.18", "5.12.1"),
    "0.5.22": ("2.14.1", "0.4.9", "0.7.1", "5.19.0"),
    "0.5.23": ("2.14.1", "0.4.10", "0.7.2", "5.19.0"),
}
# What a newer release is assumed to do as 0.5.23 does, but nothing read it: the pool
# arithmetic, which no log line confirms by itself (formats are checked line by line).
ARITHMETIC = ("kv_configurator", "spec_v2_default", "spec_v2_env", "explicit_cap_rule",
              "mamba_auto_strategy", "spec_reservation", "mamba_pool_padding",
              "lazy_extra_buffer", "mm_kv_reserve_mib", "skip_decode_lock_env",
              "draft_before_pools", "prefill_graph_rule", "graph_reserve_by_phase",
              "mm_ipc_pool_mib",
              "mem_fraction_spec_reserve_mib", "small_gpu_defaults")
_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?")


def release_key(version: str) -> tuple[int, int, int, int] | None:
    """Sort key of a release string (``0.5.12.post1`` -> (0, 5, 12, 1)); None if unparsable."""
    match = _RELEASE.match(version.strip())
    if not match:
        return None
    major, minor, patch, post = match.groups()
    return int(major), int(minor), int(patch), int(post or 0)


_KEYS = [k for k in map(release_key, KNOWN) if k is not None]


def status(version: str | None) -> str:
    """``known``; ``newer`` (than :data:`NEWEST`); ``between`` (in the range, not a published
    release: a dev or local build); ``older`` (than :data:`OLDEST`); ``invalid`` (no version)."""
    if version in KNOWN:
        return "known"
    key = release_key(version or "")
    if key is None:
        return "invalid"
    if key > _KEYS[-1]:
        return "newer"
    return "older" if key < _KEYS[0] else "between"


def _base(version: str) -> int:
    """Index in KNOWN of the newest known release not after ``version``."""
    key = release_key(version)
    if key is None or key < _KEYS[0]:
        raise ValueError(f"SGLang {version!r} is not a release from {OLDEST} on")
    return max(i for i, k in enumerate(_KEYS) if k <= key)


def traits(version: str) -> Traits:
    """The traits of ``version``: a known release's exactly; a newer or in-between build's as
    the newest known release before it. ValueError for an older release or no release."""
    base = _base(version)
    values: dict[str, Any] = {}
    for change in CHANGES:
        if _KEYS.index(release_key(change.since)) <= base:  # type: ignore[arg-type]
            values[change.trait] = change.value
    torch, kernel, flashinfer, transformers = _PINS[KNOWN[base]]
    values["pins"] = {"torch": torch, "sglang-kernel": kernel,
                      "flashinfer-python": flashinfer, "transformers": transformers}
    return dataclasses.replace(Traits(version=version), **values)


def source(trait: str, version: str) -> str:
    """Where ``trait``'s value for ``version`` was read (the release and file of its change)."""
    found = f"{OLDEST} wheel"
    base = _base(version)
    for change in CHANGES:
        if change.trait == trait and _KEYS.index(release_key(change.since)) <= base:  # type: ignore[arg-type]
            found = f"{change.since} {change.source}"
    return found


def unknown_traits(version: str | None) -> list[str]:
    """What the fleet cannot know about ``version`` and assumes instead (one line each).

    [] for a known release. A newer or in-between build: each arithmetic trait, taken from the
    newest known release before it. An older or missing version: one line saying so.
    """
    state = status(version)
    if state == "known":
        return []
    if state in ("newer", "between"):
        assumed = traits(version or NEWEST)
        like = KNOWN[_base(version or NEWEST)]
        return [f"{name} of SGLang {version}: assumed {getattr(assumed, name)!r} as in "
                f"{like} ({source(name, like)})" for name in ARITHMETIC]
    shown = f"SGLang {version}" if version else "an SGLang engine that does not say its version"
    return [f"{shown}: not a release from {OLDEST} to {NEWEST}; its log formats and pool "
            "arithmetic are not known"]


def engine_flags(version: str, flags: dict[str, Any]) -> dict[str, Any]:
    """``flags`` (dashed names, no leading ``--``) renamed to what ``version`` accepts.

    Only flags the release no longer takes are renamed (``removed_flags``); a replacement that
    carries a value (``cuda-graph-backend-prefill=disabled``) replaces a boolean flag.
    """
    removed = traits(version).removed_flags
    out: dict[str, Any] = {}
    for name, value in flags.items():
        new = removed.get(name)
        if new is None:
            out[name] = value
        elif "=" in new:
            if value:
                key, _, fixed = new.partition("=")
                out[key] = fixed
        else:
            out[new] = value
    return out
