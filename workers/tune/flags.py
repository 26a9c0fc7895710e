"""The engine's launch flags as the tuner sees them: read back from a snapshot, and diffed.

Flags are keyed by their dashed SGLang names (``max-mamba-cache-size``), as in
:class:`config.launch_profile.LaunchProfile`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from config.launch_profile import FlagValue
from workers.engine.log import parse_log

# /server_info fields that decide capacity; their values are the resolved ServerArgs.
CAPACITY_FIELDS = (
    "model_path",
    "context_length",
    "mem_fraction_static",
    "max_mamba_cache_size",
    "mamba_full_memory_ratio",
    "mamba_scheduler_strategy",
    "mamba_ssm_dtype",
    "disable_radix_cache",
    "disable_overlap_schedule",
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "kv_cache_dtype",
    "max_total_tokens",
    "chunked_prefill_size",
    "cuda_graph_max_bs",
)

FlagMap = dict[str, FlagValue]


def dashed(name: str) -> str:
    """``max_running_requests`` -> ``max-running-requests``."""
    return name.lstrip("-").replace("_", "-")


def _flags_from_server_info(info: Mapping[str, Any]) -> FlagMap:
    flags: FlagMap = {}
    for key in CAPACITY_FIELDS:
        value = info.get(key)
        if value is None or value is False:
            continue
        flags[dashed(key)] = value
    return flags


def snapshot_flags(snapshot: Mapping[str, Any]) -> FlagMap:
    """Launch flags of the engine in ``snapshot``: the profile's, /server_info's or the log's.

    The profile holds what the user asked for. ``/server_info`` holds resolved values, so its
    ``max_running_requests`` is left out (48 there may be the speculative default, not a flag).
    """
    profile = snapshot.get("profile") or {}
    if profile.get("flags"):
        return {dashed(k): v for k, v in profile["flags"].items()}
    if snapshot.get("server_info"):
        return _flags_from_server_info(snapshot["server_info"])
    return _flags_from_server_info(parse_log(snapshot.get("log") or "").server_args)


def flag_changes(old: Mapping[str, FlagValue], new: Mapping[str, FlagValue]) -> dict[str, Any]:
    """Flags that differ from ``old`` to ``new``; a removed flag maps to None."""
    changes: dict[str, Any] = {k: v for k, v in new.items() if old.get(k) != v}
    changes.update({k: None for k in old if k not in new})
    return changes


def apply_changes(flags: Mapping[str, FlagValue], changes: Mapping[str, Any]) -> FlagMap:
    """``flags`` with ``changes`` applied (None removes a flag)."""
    out = dict(flags)
    for key, value in changes.items():
        if value is None:
            out.pop(dashed(key), None)
        else:
            out[dashed(key)] = value
    return out
