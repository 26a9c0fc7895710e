"""Tests of workers.engine.capacity: SGLang 0.5.11's pool rules on shapes read from config.json.

The real engine's numbers are checked in tests/test_real_pools.py; these test the rules.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from config.launch_profile import load_profile
from workers.engine.capacity import (
    STARTUP_USED_GIB,
    EngineFlags,
    check_hybrid_flags,
    cli_max_running_requests,
    derived_defaults,
    kv_cell_bytes,
    mamba_breakdown_gib,
    mamba_ratio,
    model_shape,
    overlap_schedule,
    plan_capacity,
    vlm_mem_factor,
)

MODELS = Path(__file__).parent / "fixtures" / "models"
QWEN36_27B = model_shape(str(MODELS / "qwen36-27b-dummy"))
QWEN3_0_6B = model_shape("Qwen/Qwen3-0.6B")
B200_MIB = 183_359
H200_MIB = 143_771
H100_MIB = 81_559


def profile_plan(name: str, gpu_mib: int = H200_MIB):
    """Plan a launch profile from config/profiles on a GPU of ``gpu_mib``."""
    profile = load_profile(name)
    flags = EngineFlags.from_flags(profile.flags, profile.env)
    shape = model_shape(str(profile.flag("model-path")))
    return shape, flags, plan_capacity(shape, flags, gpu_mib)


def test_baseline_profile_caps_at_16_while_cli_says_48() -> None:
    _, _, plan = profile_plan("qwen36-27b-baseline")
    assert plan.mamba_ratio == 5
    assert plan.max_mamba_cache_size == 80
    assert plan.max_running_requests == 16  # 80 // 5, as real SGLang logged it
    assert plan.cli_max_running_requests == 48  # speculative default, what /server_info shows
    assert plan.context_len == 8192
    assert plan.max_req_len == 8191
    assert plan.max_req_input_len == 8186


def test_baseline_memory_map_adds_up_and_strands_the_speculative_reservation() -> None:
    shape, flags, plan = profile_plan("qwen36-27b-baseline")
    parts = mamba_breakdown_gib(shape, flags, plan)
    # The real engine's `Mamba Cache is allocated` line at 80 slots, 16 running.
    assert parts["ssm_state"] == pytest.approx(11.39, abs=0.01)
    assert parts["intermediate_ssm_state_cache"] == pytest.approx(9.56, abs=0.01)
    assert parts["conv_state"] == pytest.approx(0.22, abs=0.01)
    assert parts["intermediate_conv_window_cache"] == pytest.approx(0.19, abs=0.01)
    mem = plan.memory_gib
    # Reserved: 48 x 4 speculative states and 80 slots; allocated: (16 + 1) x 4 and 80 + 1.
    per_slot = shape.mamba_bytes_per_slot / 1024**3
    assert mem["free"] == pytest.approx(((48 - 17) * 4 - 1) * per_slot, abs=0.01)
    assert sum(v for k, v in mem.items() if k != "total") == pytest.approx(mem["total"])
    assert mem["total"] == pytest.approx(H200_MIB / 1024)
    assert plan.free_before_weights_gib == pytest.approx(H200_MIB / 1024 - STARTUP_USED_GIB)


def test_the_logged_free_memory_replaces_the_startup_estimate() -> None:
    shape, flags, plan = profile_plan("qwen36-27b-baseline")
    less = plan_capacity(shape, flags, H200_MIB, plan.free_before_weights_gib - 1.0)
    # rest = pre * f - weights: one GiB less before the weights is f GiB less KV.
    lost = (plan.max_total_num_tokens - less.max_total_num_tokens) * kv_cell_bytes(shape, flags)
    assert lost / 1024**3 == pytest.approx(plan.mem_fraction_static, abs=0.001)


def test_tuned_profile_runs_40() -> None:
    shape, flags, plan = profile_plan("qwen36-27b")
    assert plan.max_running_requests == 40  # 200 // 5, observed
    assert plan.cli_max_running_requests == 40
    assert plan.mem_fraction_static == 0.93
    parts = mamba_breakdown_gib(shape, flags, plan)
    # Observed at 200 slots: SSM 28.27, intermediate 23.06, conv 0.55, conv window 0.45.
    assert parts["ssm_state"] == pytest.approx(28.27, abs=0.01)
    assert parts["intermediate_ssm_state_cache"] == pytest.approx(23.06, abs=0.01)
    assert parts["conv_state"] == pytest.approx(0.55, abs=0.01)
    assert parts["intermediate_conv_window_cache"] == pytest.approx(0.45, abs=0.01)


def test_asking_for_64_with_200_slots_still_gives_40() -> None:
    _, flags, _ = profile_plan("qwen36-27b")
    flags = dataclasses.replace(flags, max_running_requests=64)
    plan = plan_capacity(QWEN36_27B, flags, H200_MIB)
    assert plan.max_running_requests == 40
    assert plan.cli_max_running_requests == 64


@pytest.mark.parametrize(
    ("changes", "ratio"),
    [
        ({"disable_radix_cache": True}, 1),
        ({}, 3),
        ({"mamba_scheduler_strategy": "no_buffer"}, 3),
        ({"mamba_scheduler_strategy": "extra_buffer"}, 5),
        ({"mamba_scheduler_strategy": "extra_buffer", "disable_overlap_schedule": True}, 4),
        ({"mamba_scheduler_strategy": "extra_buffer", "speculative_algorithm": "NEXTN"}, 5),
        (
            {
                "mamba_scheduler_strategy": "extra_buffer",
                "speculative_algorithm": "NEXTN",
                "enable_spec_v2": False,  # 0.5.10.post1 default: overlap off
            },
            4,
        ),
        (
            {
                "mamba_scheduler_strategy": "extra_buffer",
                "speculative_algorithm": "EAGLE",
                "speculative_eagle_topk": 4,
            },
            4,
        ),
        ({"mamba_scheduler_strategy": "extra_buffer", "speculative_algorithm": "NGRAM"}, 4),
        ({"disable_radix_cache": True, "mamba_scheduler_strategy": "extra_buffer"}, 1),
    ],
)
def test_mamba_ratio_per_mode(changes: dict[str, object], ratio: int) -> None:
    assert mamba_ratio(EngineFlags(**changes)) == ratio  # type: ignore[arg-type]


def test_overlap_off_for_radix_no_buffer_on_hybrid_only() -> None:
    assert overlap_schedule(EngineFlags(), hybrid=True) is False
    assert overlap_schedule(EngineFlags(), hybrid=False) is True
    assert overlap_schedule(EngineFlags(disable_radix_cache=True), hybrid=True) is True


def test_speculative_default_is_48_unless_set() -> None:
    assert cli_max_running_requests(EngineFlags(speculative_algorithm="EAGLE")) == 48
    assert cli_max_running_requests(EngineFlags(speculative_algorithm="NGRAM")) == 48
    explicit = EngineFlags(speculative_algorithm="EAGLE", max_running_requests=7)
    assert cli_max_running_requests(explicit) == 7
    assert cli_max_running_requests(EngineFlags()) is None


@pytest.mark.parametrize(
    ("gpu_mib", "tp", "chunk", "graph_bs"),
    [
        (H200_MIB, 1, 8192, 256),
        (B200_MIB, 1, 16384, 512),
        (H100_MIB, 1, 8192, 256),
        (H200_MIB, 4, 8192, 512),
        (24_576, 1, 2048, 24),
        (16_000, 1, 2048, 8),
        (49_152, 1, 4096, 32),
        (0, 1, 4096, 160),
    ],
)
def test_derived_defaults_table(gpu_mib: int, tp: int, chunk: int, graph_bs: int) -> None:
    got_chunk, got_bs, _ = derived_defaults(gpu_mib, EngineFlags(tp_size=tp))
    assert (got_chunk, got_bs) == (chunk, graph_bs)


def test_derived_mem_fraction() -> None:
    # B200: reserved = 512 + 16384*1.5 + 512*2 + 1/8*1024 = 26240 MiB; +4096 with NEXTN.
    off = EngineFlags(disable_piecewise_cuda_graph=True)
    assert derived_defaults(B200_MIB, off)[2] == round((B200_MIB - 26240) / B200_MIB, 3)
    # Piecewise CUDA graphs on (no model to turn them off): 74 sizes up to 16384, 8 MiB each.
    assert derived_defaults(B200_MIB, EngineFlags())[2] == round(
        (B200_MIB - 26240 - 74 * 8) / B200_MIB, 3)
    spec = EngineFlags(speculative_algorithm="NEXTN", disable_piecewise_cuda_graph=True)
    assert derived_defaults(B200_MIB, spec)[2] == 0.835
    # H200: 512 + 8192*1.5 + 256*2 + 128 = 13440 MiB.
    assert derived_defaults(H200_MIB, off)[2] == round((H200_MIB - 13440) / H200_MIB, 3)
    assert derived_defaults(0, EngineFlags())[2] == 0.88
    assert derived_defaults(B200_MIB, EngineFlags(mem_fraction_static=0.5))[2] == 0.5
    # The VLM factor scales only the derived value.
    assert derived_defaults(B200_MIB, spec, QWEN36_27B)[2] == pytest.approx(
        0.835 * 0.95 * (1 - 0.1 * (1152**2 / 1024**2 - 1))  # adjust_mem_fraction_for_vlm
    )
    fixed = EngineFlags(mem_fraction_static=0.9)
    assert derived_defaults(B200_MIB, fixed, QWEN36_27B)[2] == 0.9


def test_piecewise_cuda_graphs_reserve_8_mib_per_captured_size_where_they_stay_on() -> None:
    # 58 sizes up to chunked_prefill_size 8192: 13440 + 464 MiB on an H200 for a dense model.
    dense = derived_defaults(H200_MIB, EngineFlags(), QWEN3_0_6B)[2]
    assert dense == round((H200_MIB - 13440 - 58 * 8) / H200_MIB, 3)
    off = EngineFlags(disable_piecewise_cuda_graph=True)
    assert derived_defaults(H200_MIB, off, QWEN3_0_6B)[2] == 0.907  # the real dense run
    # Off for multimodal models and the listed architectures (Qwen3-Next) without the flag.
    nxt = model_shape(str(MODELS / "qwen3next-tiny"))
    assert derived_defaults(H200_MIB, EngineFlags(), nxt)[2] == 0.907
    assert derived_defaults(H200_MIB, EngineFlags(speculative_algorithm="NEXTN"),
                            QWEN36_27B)[2] == pytest.approx(0.8119442187499999)


def test_from_flags_accepts_dashes_underscores_and_strings() -> None:
    flags = EngineFlags.from_flags(
        {
            "--max-running-requests": "64",
            "max_mamba_cache_size": 200,
            "mamba-full-memory-ratio": "0.6",
            "disable-radix-cache": True,
            "speculative-algorithm": "nextn",
            "max-total-tokens": "32k",
            "tensor-parallel-size": 2,
            "reasoning-parser": "qwen3",  # irrelevant flags are ignored
        },
        env={"SGLANG_ENABLE_SPEC_V2": "0"},
    )
    assert flags.max_running_requests == 64
    assert flags.max_mamba_cache_size == 200
    assert flags.mamba_full_memory_ratio == 0.6
    assert flags.disable_radix_cache is True
    assert flags.speculative_algorithm == "NEXTN"
    assert flags.max_total_tokens == 32_000
    assert flags.tp_size == 2
    assert flags.enable_spec_v2 is False


def test_speculative_with_radix_no_buffer_is_rejected_on_hybrid() -> None:
    flags = EngineFlags(speculative_algorithm="NEXTN")
    with pytest.raises(ValueError, match="extra_buffer"):
        plan_capacity(QWEN36_27B, flags, B200_MIB)
    assert plan_capacity(QWEN3_0_6B, flags, B200_MIB).max_running_requests == 48


def test_a_draft_that_does_not_fit_after_the_target_runs_out_of_cuda_memory() -> None:
    # A tiny hybrid with MTP: the target's KV pool takes the fraction, the draft's own pool of
    # as many tokens does not fit in what is left (the real run OOMed there).
    tiny = model_shape(str(MODELS / "qwen3next-tiny"))
    flags = EngineFlags(speculative_algorithm="NEXTN", mamba_scheduler_strategy="extra_buffer")
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        plan_capacity(tiny, flags, H200_MIB)
    capped = dataclasses.replace(flags, max_total_tokens=1_000_000)
    assert plan_capacity(tiny, capped, H200_MIB).max_total_num_tokens == 1_000_000


def test_not_enough_memory() -> None:
    with pytest.raises(RuntimeError, match="Not enough memory"):
        plan_capacity(QWEN36_27B, EngineFlags(disable_radix_cache=True), 40_000)


def test_auto_slots_follow_mamba_full_memory_ratio() -> None:
    low = plan_capacity(QWEN36_27B, EngineFlags(mamba_full_memory_ratio=0.6), B200_MIB)
    high = plan_capacity(QWEN36_27B, EngineFlags(), B200_MIB)
    assert high.max_mamba_cache_size > low.max_mamba_cache_size > 0
    assert high.max_total_num_tokens < low.max_total_num_tokens
    assert high.max_running_requests == high.max_mamba_cache_size // 3


def test_disable_radix_uses_the_cap_as_slot_count() -> None:
    flags = EngineFlags(disable_radix_cache=True, max_running_requests=96)
    plan = plan_capacity(QWEN36_27B, flags, B200_MIB)
    assert (plan.max_mamba_cache_size, plan.mamba_ratio, plan.max_running_requests) == (96, 1, 96)


def test_bf16_ssm_state_doubles_slots_per_gib() -> None:
    flags = EngineFlags(mamba_scheduler_strategy="extra_buffer", max_mamba_cache_size=100)
    fp32 = mamba_breakdown_gib(QWEN36_27B, flags, plan_capacity(QWEN36_27B, flags, B200_MIB))
    half = dataclasses.replace(flags, mamba_ssm_dtype="bfloat16")
    bf16 = mamba_breakdown_gib(QWEN36_27B, half, plan_capacity(QWEN36_27B, half, B200_MIB))
    assert bf16["ssm_state"] == pytest.approx(fp32["ssm_state"] / 2)
    assert bf16["conv_state"] == pytest.approx(fp32["conv_state"])


def test_fp8_kv_cache_halves_the_cell() -> None:
    flags = EngineFlags(disable_radix_cache=True, max_running_requests=48)
    fp8 = dataclasses.replace(flags, kv_cache_dtype="fp8_e4m3")
    assert kv_cell_bytes(QWEN36_27B, fp8) == kv_cell_bytes(QWEN36_27B, flags) / 2 == 16384
    one = plan_capacity(QWEN36_27B, flags, H200_MIB).max_total_num_tokens
    two = plan_capacity(QWEN36_27B, fp8, H200_MIB).max_total_num_tokens
    assert two == pytest.approx(2 * one, abs=2)


def test_kv_heads_are_split_by_tp_and_replicated_below_one_per_gpu() -> None:
    llama = model_shape(str(MODELS / "llama31-8b-shape"))  # 8 KV heads
    assert kv_cell_bytes(llama, EngineFlags(tp_size=2)) == llama.kv_bytes_per_token / 2
    assert kv_cell_bytes(llama, EngineFlags(tp_size=8)) == llama.kv_bytes_per_token / 8
    tiny = model_shape(str(MODELS / "qwen3-tiny"))  # 2 KV heads: one each on 4 GPUs
    assert kv_cell_bytes(tiny, EngineFlags(tp_size=4)) == tiny.kv_bytes_per_token / 2


def test_dense_model_caps_and_clips() -> None:
    plan = plan_capacity(QWEN3_0_6B, EngineFlags(max_running_requests=10_000), H200_MIB)
    assert plan.max_running_requests == 4096  # clipped to `estimated` <= 4096
    assert plan.mamba_ratio == 0 and plan.max_mamba_cache_size == 0
    small = plan_capacity(QWEN3_0_6B, EngineFlags(max_total_tokens=5000), H200_MIB)
    assert small.max_total_num_tokens == 5000
    assert small.max_req_len == 4999
    assert small.max_running_requests == 2048  # min(estimated=2048, tokens // 2 = 2500)


def test_int_flags_take_plain_integers_only_max_total_tokens_is_human_readable() -> None:
    assert EngineFlags.from_flags({"max-total-tokens": "128Ki"}).max_total_tokens == 131072
    for flag in ("max-running-requests", "chunked-prefill-size", "context-length"):
        with pytest.raises(ValueError):
            EngineFlags.from_flags({flag: "32k"})


def test_extra_buffer_without_radix_cache_is_rejected() -> None:
    flags = EngineFlags(mamba_scheduler_strategy="extra_buffer", disable_radix_cache=True)
    with pytest.raises(ValueError, match="requires the radix cache"):
        check_hybrid_flags(flags)


def test_the_draft_model_comes_out_of_the_reserve_not_the_pool() -> None:
    shape, flags, plan = profile_plan("qwen36-27b-baseline")
    heavier = dataclasses.replace(shape, draft_weights_gib=shape.draft_weights_gib + 4.0)
    other = plan_capacity(heavier, flags, H200_MIB)
    # The draft worker starts after the target's pools are sized: KV and slots do not move.
    assert other.max_total_num_tokens == plan.max_total_num_tokens
    draft_kv = plan.max_total_num_tokens * shape.draft_kv_bytes_per_token / 1024**3
    assert plan.memory_gib["draft"] == pytest.approx(shape.draft_weights_gib + draft_kv)
    assert other.memory_gib["reserved"] == pytest.approx(plan.memory_gib["reserved"] - 4.0)


def test_vlm_factor_is_sglangs_formula_from_the_vision_config() -> None:
    assert vlm_mem_factor(None) == 1.0
    assert vlm_mem_factor((24, 1024)) == pytest.approx(0.95)  # a ViT-L/14: the baseline
    assert vlm_mem_factor((48, 2048)) == pytest.approx(0.95 * 0.8)  # clamped
    assert QWEN36_27B.vision == (24, 1152)
