"""The answers and lines of the SGLang release the simulator plays (FLEET_SIM_SGLANG_VERSION).

The simulator builds every answer in 0.5.11's shape; this module reshapes what later releases
changed (:mod:`workers.engine.releases` names the file each change was read from):

- ``/server_info``: ``internal_states[].memory_usage`` from 0.5.17 has ``graph`` by capture
  phase, ``startup_available`` and ``token_capacity_swa``
  (``managers/scheduler_components/memory_usage.py::build_memory_usage``), and the top level a
  ``startup_time``;
- ``/v1/loads``: from 0.5.13 no ``dp_rank_count``, ``aggregate`` or ``loads[].num_total_reqs``,
  one ``num_waiting_uncached_tokens`` per rank (``managers/load_snapshot.py``); from 0.5.17
  ``accelerator`` and ``num_accelerators`` (``entrypoints/v1_loads.py``);
- the KV and CUDA graph start-up lines (:func:`kv_line`, :func:`graph_lines`).
"""

from __future__ import annotations

from typing import Any

from workers.engine.releases import OLDEST, Traits, traits

# ``KVCache.dtype`` as the KV line prints it (torch dtype names), by --kv-cache-dtype.
TORCH_KV_DTYPE = {"fp8_e4m3": "torch.float8_e4m3fn", "fp8_e5m2": "torch.float8_e5m2",
                  "fp4_e2m1": "torch.float4_e2m1fn_x2"}
GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode",
                "draft_extend")


def sim_release(version: str) -> Traits:
    """The traits the simulator plays ``version`` with (an unknown older one: the oldest's)."""
    try:
        return traits(version)
    except ValueError:
        return traits(OLDEST)


def kv_line(release: Traits, tokens: int, k_gib: float, v_gib: float, kv_dtype: str) -> str:
    """``KV Cache is allocated`` (``mem_cache/memory_pool.py``) in the release's words."""
    dtype = ""
    if release.kv_line_dtype:
        dtype = f"dtype: {TORCH_KV_DTYPE.get(kv_dtype, 'torch.bfloat16')}, "
    return (f"KV Cache is allocated. {dtype}#tokens: {tokens}, K size: {k_gib:.2f} GB, "
            f"V size: {v_gib:.2f} GB")


def graph_lines(release: Traits, speculative: int, sizes: list[int], avail: float,
                used: float, elapsed_s: float) -> tuple[list[str], str]:
    """(lines before the capture, the line after it) of the target's decode CUDA graphs.

    ``speculative`` is the number of draft tokens per request (0 without speculation).
    """
    if release.graph_line == "legacy":
        begin = [f"Capture cuda graph begin. This can take up to several minutes. "
                 f"avail mem={avail:.2f} GB"]
        if release.graph_bs_line:
            begin.append(f"Capture cuda graph bs {sizes}")
        end = (f"Capture cuda graph end. Time elapsed: {elapsed_s:.2f} s. "
               f"mem usage={used:.2f} GB. avail mem={avail - used:.2f} GB.")
        return begin, end
    name = "target verify" if speculative else "target decode"
    per_req = speculative or 1
    bs_begin = f"bs={sizes}, " if release.graph_line == "named" else ""
    bs_end = f"bs={sizes}, " if release.graph_line == "named_bs_end" else ""
    begin = [f"Capture {name} CUDA graph begin. backend=full, num_tokens_per_req={per_req}, "
             f"{bs_begin}avail mem={avail:.2f} GB"]
    end = (f"Capture {name} CUDA graph end. {bs_end}elapsed={elapsed_s:.2f} s, "
           f"mem usage={used:.2f} GB, avail mem={avail - used:.2f} GB.")
    return begin, end


def _memory_usage(usage: dict[str, Any], speculative: bool, avail_gib: float) -> dict[str, Any]:
    """``build_memory_usage`` (0.5.17 on) from the 0.5.11-shaped ``memory_usage``."""
    graph = dict.fromkeys(GRAPH_PHASES, 0.0)
    graph["target_verify" if speculative else "decode"] = round(float(usage["graph"]), 3)
    return {"weight": round(usage["weight"], 3), "kvcache": round(usage["kvcache"], 3),
            "startup_available": round(avail_gib, 3),
            "token_capacity": usage["token_capacity"], "token_capacity_swa": None,
            "graph": graph}


def shape_server_info(doc: dict[str, Any], release: Traits, speculative: bool,
                      started_at: float) -> dict[str, Any]:
    """The /server_info document as ``release`` writes it."""
    if release.memory_usage_graph == "by_phase":
        for entry in doc.get("internal_states") or []:
            usage = entry.get("memory_usage")
            if isinstance(usage, dict) and not isinstance(usage.get("graph"), dict):
                entry["memory_usage"] = _memory_usage(usage, speculative, 0.0)
    if release.server_info_startup_time:
        doc["startup_time"] = started_at
    return doc


def shape_loads(doc: dict[str, Any], release: Traits) -> dict[str, Any]:
    """The /v1/loads document as ``release`` writes it."""
    if not release.loads_aggregate:
        doc.pop("dp_rank_count", None)
        doc.pop("aggregate", None)
        for entry in doc.get("loads") or []:
            entry.pop("num_total_reqs", None)
            entry.setdefault("dp_rank", 0)  # LoadSnapshot writes it at dp 1 too
            entry.setdefault("num_waiting_uncached_tokens", 0)
    if release.loads_accelerator:
        loads = doc.pop("loads", [])
        doc.update(accelerator="NVIDIA H200 (simulated)", num_accelerators=1, loads=loads)
    return doc
