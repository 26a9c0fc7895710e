"""Pool arithmetic against real SGLang 0.5.11 on one H200 (tests/fixtures/sglang/0.5.11/real-h200/).

Each capture's launch flags (its README) and the model's config.json (tests/fixtures/models/) are
all the prediction gets, plus the GPU's memory (143,771 MiB). Against the capture's own
``server.log`` and ``/server_info``: ``mem_fraction_static`` and the cap are exact, the KV tokens
within 1 % as the issue asks (0.08 % at worst: the two-decimal rounding of the logged free
memory the start-up constant comes from, docs/capacity.md), and within 0.05 % once the log's
``Load weight`` lines give the free memory and the weights, as the tuner reads them. Captures
that ``bench/gpu_configs.py`` wrote are found and checked the same way from their flags: the
families of issue 28 (a Falcon-H1-7B shape: Mamba-2 on every layer; DeepSeek-V2-Lite: MLA +
MoE; gpt-oss-20b: sliding window with sinks; Gemma-3-1B; Qwen3-30B-A3B) with the cap and Mamba
slots exact, KV within 0.04 % and the weights counted from config.json within 0.1 %, and the
Nemotron-H launch SGLang refused on the triton backend; issue 36's Granite-4.0-H (pools, then
the triton backend's refusal), Nemotron-H on torch_native and DeepSeek-V2-Lite with CUDA graphs;
and SGLang 0.5.17's own captures (tests/fixtures/sglang/0.5.17/real-h200/), planned with 0.5.17's
arithmetic.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from workers.engine.capacity import (
    EngineFlags,
    conv_bytes_per_slot,
    kv_cell_bytes,
    mamba_breakdown_gib,
    model_shape,
    plan_capacity,
)
from workers.engine.log import LogFacts, parse_log

FIXTURES = Path(__file__).parent / "fixtures"
REAL = FIXTURES / "sglang" / "0.5.11" / "real-h200"
H200_MIB = 143_771
SPEC = {"speculative-algorithm": "NEXTN", "speculative-num-steps": 3,
        "speculative-eagle-topk": 1, "speculative-num-draft-tokens": 4,
        "mamba-scheduler-strategy": "extra_buffer"}
TUNED = {**SPEC, "max-mamba-cache-size": 200, "mamba-full-memory-ratio": 0.6,
         "mem-fraction-static": 0.93}
# stage -> (model folder, launch flags beyond --context-length 8192 and the kit's backends)
STAGES = {
    "big80": ("qwen36-27b-dummy", {**SPEC, "max-mamba-cache-size": 80}),
    "big200": ("qwen36-27b-dummy", {**TUNED, "max-running-requests": 64}),
    "big200_40": ("qwen36-27b-dummy", {**TUNED, "max-running-requests": 40}),
    "dense": ("qwen3-tiny", {"disable-piecewise-cuda-graph": True}),
}
ENV = {"SGLANG_ENABLE_SPEC_V2": "1"}


def _capture(stage: str) -> tuple[dict, LogFacts]:
    text = (REAL / stage / "04_before_server_info.txt").read_text()
    info = json.loads(text[text.index("{"):])
    return info, parse_log((REAL / stage / "server.log").read_text())


def _predict(stage: str, from_log: LogFacts | None = None):
    model, extra = STAGES[stage]
    shape = model_shape(str(FIXTURES / "models" / model))
    flags = EngineFlags.from_flags({"context-length": 8192, **extra}, ENV)
    free = None
    if from_log is not None:
        free = from_log.weights_begin_avail_gib + shape.pre_load_gib  # SGLang's own `pre`
        weights = from_log.weights_begin_avail_gib - from_log.weights_end_avail_gib
        shape = dataclasses.replace(shape, weights_gib=weights)
    return shape, flags, plan_capacity(shape, flags, H200_MIB, free)


@pytest.mark.parametrize("stage", list(STAGES))
def test_from_the_config_alone_the_cap_is_exact_and_kv_within_one_percent(stage: str) -> None:
    info, log = _capture(stage)
    _, _, plan = _predict(stage)
    assert plan.mem_fraction_static == pytest.approx(info["mem_fraction_static"], abs=1e-12)
    assert plan.max_running_requests == log.scheduler.max_running_requests
    assert plan.max_running_requests == info["internal_states"][0][
        "effective_max_running_requests_per_dp"]
    assert plan.cli_max_running_requests == info["max_running_requests"]
    real = log.scheduler.max_total_num_tokens
    assert plan.max_total_num_tokens == pytest.approx(real, rel=0.01)
    # What is left is the logged figures' rounding (0.005 GiB each): under 0.1 %.
    assert abs(plan.max_total_num_tokens - real) <= real * 0.001
    assert plan.free_before_weights_gib == pytest.approx(log.weights_begin_avail_gib, abs=0.01)
    assert plan.max_req_input_len == info.get("max_req_input_len", plan.max_req_input_len)


@pytest.mark.parametrize("stage", list(STAGES))
def test_from_the_logged_free_memory_kv_is_within_the_logs_rounding(stage: str) -> None:
    _, log = _capture(stage)
    shape, flags, plan = _predict(stage, from_log=log)
    real = log.scheduler.max_total_num_tokens
    # `post` is printed to 0.01 GiB: 0.005 GiB of KV either way, and `pre` scaled by 1 - f.
    slack = 0.0125 * 1024**3 / kv_cell_bytes(shape, flags)
    assert abs(plan.max_total_num_tokens - real) <= slack
    assert plan.max_running_requests == log.scheduler.max_running_requests


@pytest.mark.parametrize("stage", ["big80", "big200", "big200_40"])
def test_every_mamba_buffer_is_the_logged_size(stage: str) -> None:
    _, log = _capture(stage)
    shape, flags, plan = _predict(stage)
    parts = {k: round(v, 2) for k, v in mamba_breakdown_gib(shape, flags, plan).items()}
    mamba = log.mamba
    assert plan.max_mamba_cache_size == mamba.slots
    assert parts == {"conv_state": mamba.conv_gib, "ssm_state": mamba.ssm_gib,
                     "intermediate_ssm_state_cache": mamba.intermediate_ssm_gib,
                     "intermediate_conv_window_cache": mamba.intermediate_conv_gib}


@pytest.mark.parametrize("stage", list(STAGES))
def test_the_kv_pool_and_the_weights_are_the_logged_sizes(stage: str) -> None:
    _, log = _capture(stage)
    shape, _, plan = _predict(stage, from_log=log)
    assert plan.memory_gib["kv"] == pytest.approx(log.kv_gib, abs=0.03)
    assert model_shape(str(FIXTURES / "models" / STAGES[stage][0])).weights_gib == (
        pytest.approx(log.weights_gib, abs=0.03))


@pytest.mark.parametrize("stage", ["big80", "big200", "big200_40"])
def test_the_draft_fits_in_what_the_target_left(stage: str) -> None:
    """The MTP draft loads after the target's pools and graphs: 5.52 GB while loading, then a KV
    pool of as many tokens for its one attention layer (the second KV line of the log)."""
    _, log = _capture(stage)
    shape, _, plan = _predict(stage, from_log=log)
    tokens = plan.max_total_num_tokens
    draft_kv = tokens * shape.draft_kv_bytes_per_token / 1024**3
    assert draft_kv / 2 == pytest.approx(
        round(log.scheduler.max_total_num_tokens * 1024 / 1024**3, 2), abs=0.01)
    assert shape.draft_load_gib == pytest.approx(5.52, abs=0.01)
    left = plan.free_before_weights_gib - sum(
        plan.memory_gib[k] for k in ("weights", "mamba", "mamba_intermediate", "kv"))
    assert left == pytest.approx(log.pool_end_avail_gib, abs=0.06)


def _new_captures(root: Path = REAL) -> dict[str, tuple[str, dict]]:
    """Captures written by ``bench/gpu_configs.py`` (a ``summary.json`` with the launch flags):
    copied in here, each is checked like the four above, from its flags and its model's
    config.json under tests/fixtures/models/ (the model-path's folder name)."""
    found = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in STAGES):
        summary = folder / "summary.json"
        data = json.loads(summary.read_text()) if summary.is_file() else {}
        flags = data.get("flags") if isinstance(data, dict) else None
        slow = "not healthy after" in str(data.get("error", "")) if isinstance(data, dict) else 0
        if isinstance(flags, dict) and (folder / "server.log").is_file() and not slow:
            model = Path(str(flags.get("model-path", ""))).name
            found[folder.name] = (model, {k: v for k, v in flags.items() if k != "model-path"})
    return found


# release -> its captures' folder (bench/gpu_configs.py on the lent H200; README.md beside them)
RELEASE_CAPTURES = {"0.5.11": REAL, "0.5.17": FIXTURES / "sglang" / "0.5.17" / "real-h200"}
LAUNCHES = sorted((version, stage, launch) for version, root in RELEASE_CAPTURES.items()
                  for stage, launch in _new_captures(root).items())


@pytest.mark.parametrize(("version", "stage", "launch"), LAUNCHES)
def test_every_new_capture_is_predicted_from_its_flags_and_config(version, stage, launch) -> None:
    model, flags = launch
    root = RELEASE_CAPTURES[version]
    log = parse_log((root / stage / "server.log").read_text())
    shape = model_shape(str(FIXTURES / "models" / model))
    engine_flags = EngineFlags.from_flags({"context-length": 8192, **flags}, ENV, version=version)
    if log.scheduler is None:  # the real engine refused or died at start: so must the plan
        with pytest.raises((ValueError, RuntimeError)):
            plan_capacity(shape, engine_flags, H200_MIB)
        return
    plan = plan_capacity(shape, engine_flags, H200_MIB)
    assert plan.max_running_requests == log.scheduler.max_running_requests
    # 0.1 %, or for a small pool the start-up constant's precision: it comes from free memory
    # logged to 0.01 GB, which is 327 tokens of this hybrid's KV (the bf16-SSM launch's pool is
    # 29,441 tokens, predicted 29,741).
    precision = 0.01 * 2**30 / kv_cell_bytes(shape, engine_flags)
    assert plan.max_total_num_tokens == pytest.approx(
        log.scheduler.max_total_num_tokens,
        abs=max(0.001 * log.scheduler.max_total_num_tokens, precision))
    # The issue asks 2 %; every family's count is within 0.1 % of the logged `mem usage` (the
    # DeepSeek-V2-Lite shape 0.02 GiB light, the rest to the log's two decimals).
    assert shape.weights_gib == pytest.approx(log.weights_gib, abs=0.0051, rel=0.001)
    if log.mamba is not None:
        assert plan.max_mamba_cache_size == log.mamba.slots
        parts = mamba_breakdown_gib(shape, engine_flags, plan)
        assert round(parts["ssm_state"], 2) == log.mamba.ssm_gib
        assert round(parts["conv_state"], 2) == log.mamba.conv_gib


def test_granite_4_0_h_pools_are_predicted_before_the_triton_backend_refuses_it() -> None:
    """Granite-4.0-H (first layer Mamba-2) on ``--attention-backend triton``: SGLang 0.5.11
    sized its pools (220 Mamba slots, 2,283,505 KV tokens), then ``TritonAttnBackend.__init__``
    asked for layer 0's value buffer and died (``layer_id=0 not in full attention layers``).
    The plan refuses that launch with the same words, and on another backend gives the pools
    the engine logged."""
    from workers.engine.launch_refusals import known_refusals

    text = (REAL / "granite_4_0_h" / "server.log").read_text()
    assert "layer_id=0 not in full attention layers" in text
    log = parse_log(text)
    shape = model_shape(str(FIXTURES / "models" / "granite-4.0-h-small-shape"))
    base = {"context-length": 8192, "disable-piecewise-cuda-graph": True,
            "disable-cuda-graph": True}
    refused = known_refusals(shape, EngineFlags.from_flags(
        {**base, "attention-backend": "triton"}))
    assert any("layer_id=0 not in full attention layers" in str(r) for r in refused)
    flags = EngineFlags.from_flags({**base, "attention-backend": "torch_native"})
    plan = plan_capacity(shape, flags, H200_MIB)
    assert plan.max_mamba_cache_size == log.mamba.slots == 220
    assert plan.max_total_num_tokens == pytest.approx(log.kv_tokens, rel=0.001)
    parts = mamba_breakdown_gib(shape, flags, plan)
    assert (round(parts["ssm_state"], 2), round(parts["conv_state"], 2)) == (
        log.mamba.ssm_gib, log.mamba.conv_gib)
    assert shape.weights_gib == pytest.approx(log.weights_gib, abs=0.0051)


BIG80_0517 = FIXTURES / "sglang" / "0.5.17" / "real-h200" / "big80_unhealthy"


def _big80_0517():
    shape = model_shape(str(FIXTURES / "models" / "qwen36-27b-dummy"))
    flags = EngineFlags.from_flags({"context-length": 8192, **SPEC, "max-mamba-cache-size": 80},
                                   ENV, version="0.5.17")
    return shape, flags, plan_capacity(shape, flags, H200_MIB)


def test_the_27b_stand_in_on_0_5_17_caps_and_sizes_its_mamba_pool_as_planned() -> None:
    """SGLang 0.5.17 with the baseline launch (80 slots, MTP): its pools were allocated and
    logged, then the 58 prefill CUDA graphs it captures for this multimodal model took longer
    than the call's 128 s health wait. The cap line, the Mamba slots and the conv/SSM buffers
    are the plan's; the intermediate conv window is half the dense size: 0.5.17 keeps one
    ``D + K - 2`` window per request (``memory_pool.py::_allocate_deduplicated_conv_window``,
    topk 1), not ``D`` windows of ``K - 1``."""
    text = BIG80_0517.joinpath("server.log").read_text()
    log = parse_log(text)
    shape, flags, plan = _big80_0517()
    cap = re.search(r"max_running_requests is capped to (\d+) by the mamba state cache", text)
    assert cap is not None and int(cap.group(1)) == plan.max_running_requests == 16
    assert log.mamba.slots == plan.max_mamba_cache_size == 80
    parts = mamba_breakdown_gib(shape, flags, plan)
    assert (round(parts["conv_state"], 2), round(parts["ssm_state"], 2),
            round(parts["intermediate_ssm_state_cache"], 2),
            round(parts["intermediate_conv_window_cache"], 2)) == (
        log.mamba.conv_gib, log.mamba.ssm_gib, log.mamba.intermediate_ssm_gib,
        log.mamba.intermediate_conv_gib)
    draft, kernel = 4, shape.mamba_conv_kernel
    dense = (plan.max_running_requests + 1) * draft * conv_bytes_per_slot(shape, flags) / 2**30
    assert parts["intermediate_conv_window_cache"] == pytest.approx(
        dense * (draft + kernel - 2) / (draft * (kernel - 1)))
    assert (kernel, log.mamba.intermediate_conv_gib, round(dense, 2)) == (4, 0.09, 0.19)
    assert (log.weights_gib, log.draft_weights_gib) == (50.89, 5.52)
    assert shape.weights_gib == pytest.approx(log.weights_gib, abs=0.0051)


def test_the_27b_stand_in_on_0_5_17_kv_pool_is_within_one_percent() -> None:
    """0.5.17 sizes this multimodal MTP hybrid's KV pool 16 % under 0.5.11's arithmetic, for
    three reasons read from its wheel: the draft's weights (5.52 GB) load before the pools are
    sized (``Scheduler.init_memory_pools``); the tokenizer holds a 1 GiB CUDA-IPC feature pool
    and its own CUDA context on GPU 0 before ``pre`` is measured
    (``_handle_multimodal_feature_transport``); and the 58 breakable prefill graphs this
    architecture keeps are reserved (``reserve_for_graph_mb``), which lowers the fraction."""
    text = BIG80_0517.joinpath("server.log").read_text()
    log = parse_log(text)
    shape, flags, plan = _big80_0517()
    fraction = re.search(r"mem_fraction_static=([\d.]+)", text)
    assert fraction is not None
    assert plan.mem_fraction_static == pytest.approx(float(fraction.group(1)), abs=1e-12)
    # 139.13 GiB free on 0.5.11 (STARTUP_USED_GIB) less 1,024 + 527 MiB: 137.615, logged 137.61
    assert log.weights_begin_avail_gib == 137.61
    assert plan.free_before_weights_gib == pytest.approx(137.61, abs=0.01)
    assert plan.max_total_num_tokens == pytest.approx(log.kv_tokens, rel=0.001)
    weights = log.weights_begin_avail_gib - log.weights_end_avail_gib
    from_log = plan_capacity(dataclasses.replace(shape, weights_gib=weights), flags, H200_MIB,
                             log.weights_begin_avail_gib)
    assert from_log.max_total_num_tokens == pytest.approx(log.kv_tokens, rel=0.001)


def test_the_families_pools_are_the_ones_sglang_gave_them() -> None:
    """gpt-oss: a full pool for its 12 full layers and a sliding-window pool of 0.8 x as many
    tokens for the other 12 (``SWAKVPool``); Gemma-3: one full pool for all 26 layers, since
    ``ServerArgs._handle_model_specific_adjustments`` disables hybrid SWA memory for Gemma3;
    Falcon-H1: a Mamba pool and a KV pool over all 44 layers; DeepSeek-V2: the MLA latent."""
    swa = re.search(r"SWAKVPool mem usage: [\d.]+ GB, swa size: (\d+), full size: (\d+)",
                    (REAL / "gpt_oss_20b" / "server.log").read_text())
    assert swa is not None
    shape = model_shape(str(FIXTURES / "models" / "gpt-oss-20b"))
    flags = EngineFlags.from_flags({"context-length": 8192, "disable-piecewise-cuda-graph": True})
    plan = plan_capacity(shape, flags, H200_MIB)
    full = plan.max_total_num_tokens
    assert (shape.full_attention_layers, shape.swa_layers) == (12, 12)
    assert int(swa.group(1)) == int(int(swa.group(2)) * 0.8)
    assert abs(full - int(swa.group(2))) <= 0.001 * full
    gemma = (REAL / "gemma3_1b" / "server.log").read_text()
    assert "Disable hybrid SWA memory for Gemma3ForCausalLM" in gemma
    g = model_shape(str(FIXTURES / "models" / "gemma-3-1b"))
    assert (g.full_attention_layers, g.swa_layers) == (26, 0)
    assert g.kv_bytes_per_token == 26 * 1 * 512 * 2
    falcon = model_shape(str(FIXTURES / "models" / "falcon-h1-7b"))
    assert (falcon.full_attention_layers, falcon.linear_attention_layers) == (44, 44)
    lite = model_shape(str(FIXTURES / "models" / "deepseek-v2-lite"))
    assert (lite.kv_heads, lite.kv_bytes_per_token) == (0, 27 * (512 + 64) * 2)


def test_the_sim_playing_0_5_17_gives_the_real_engine_s_pools(tmp_path: Path) -> None:
    """The simulator launched with the capture's argv as 0.5.17: /server_info holds the KV
    tokens, Mamba slots and cap the real 0.5.17 engine allocated (its pools come from the same
    arithmetic)."""
    from tests.simproc import launch

    argv = BIG80_0517.joinpath("argv.txt").read_text().split()
    argv = argv[argv.index("--model-path"):argv.index("--host")]
    argv[1] = str(FIXTURES / "models" / "qwen36-27b-dummy")
    log = parse_log(BIG80_0517.joinpath("server.log").read_text())
    sim = launch(tmp_path, argv, {"FLEET_SIM_SGLANG_VERSION": "0.5.17",
                                  "FLEET_SIM_GPU_MEMORY_MIB": str(H200_MIB), **ENV})
    try:
        sim.wait_ready()
        info = sim.get("/server_info").json()
    finally:
        sim.stop()
    state = info["internal_states"][0]
    assert info["max_total_num_tokens"] == pytest.approx(log.kv_tokens, rel=0.001)
    assert info["mem_fraction_static"] == pytest.approx(0.835063359375, abs=1e-12)
    assert state["max_mamba_cache_size"] == log.mamba.slots == 80
    assert state["effective_max_running_requests_per_dp"] == 16
