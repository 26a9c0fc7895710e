"""Each SGLang release's pool and cap arithmetic, as its wheel's source writes it.

The expected values are worked out here from the formulas of each release's
``handle_max_mamba_cache`` / ``_resolve_max_num_reqs`` / ``_calculate_mamba_ratio``
(``model_executor/model_runner_kv_cache_mixin.py`` to 0.5.15.post1,
``mem_cache/kv_cache_configurator.py`` from 0.5.16) and ``server_args.py``; only the inputs
that no release changes (the model's bytes per Mamba slot and per KV token, the weights, the
GPU's free memory, the reserve formula's terms) come from :mod:`workers.engine`. Only 0.5.11's
and 0.5.17's arithmetic are checked against a real engine (tests/test_real_pools.py, one H200).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.simproc import launch
from workers.engine import capacity, launch_refusals, server_args
from workers.engine.capacity import GIB, STARTUP_USED_GIB, EngineFlags, model_shape
from workers.engine.releases import KNOWN, release_key

MODELS = Path(__file__).parent / "fixtures" / "models"
QWEN36 = model_shape(str(MODELS / "qwen36-27b-dummy"))  # Qwen3_5ForConditionalGeneration
DENSE = model_shape(str(MODELS / "llama31-8b-shape"))
H200_MIB = 143_771
CTX = {"context-length": 8192}
SPEC = {**CTX, "speculative-algorithm": "NEXTN", "speculative-num-steps": 3,
        "speculative-eagle-topk": 1, "speculative-num-draft-tokens": 4,
        "mamba-scheduler-strategy": "extra_buffer"}
BASELINE = {**SPEC, "max-mamba-cache-size": 80}
TUNED = {**SPEC, "max-mamba-cache-size": 200, "mamba-full-memory-ratio": 0.6,
         "mem-fraction-static": 0.93, "max-running-requests": 40}
ENV = {"SGLANG_ENABLE_SPEC_V2": "1"}


def since(version: str, first: str) -> bool:
    """Whether ``version`` is ``first`` or later."""
    return release_key(version) >= release_key(first)  # type: ignore[operator]


def plan(shape: capacity.ModelShape, flags: dict, version: str, env: dict | None = None,
         gpu_mib: int = H200_MIB) -> capacity.CapacityPlan:
    return capacity.plan_capacity(
        shape, EngineFlags.from_flags(flags, ENV if env is None else env, None, version), gpu_mib)


def fraction(shape: capacity.ModelShape, flags: dict, version: str) -> float:
    """mem_fraction_static: the flag, else ``_handle_gpu_memory_settings``'s
    ``round((gpu - reserved) / gpu, 3)`` times the VLM factor; the 4096 MiB EAGLE/NEXTN term
    of ``reserved`` is there through 0.5.13 and gone from 0.5.14."""
    if "mem-fraction-static" in flags:
        return flags["mem-fraction-static"]
    f11 = EngineFlags.from_flags(flags, ENV, None, "0.5.11")
    chunk, graph, _ = server_args.derived_defaults(H200_MIB, f11, shape)
    reserved = server_args.reserved_mib(chunk, graph, f11, H200_MIB, shape)  # with the 4096
    if since(version, "0.5.14") and "speculative-algorithm" in flags:
        reserved -= 4096
    if since(version, "0.5.17") and shape.architecture == "Qwen3_5ForConditionalGeneration":
        # reserve_for_graph_mb: the breakable prefill graphs this multimodal arch keeps (0.5.11
        # turned piecewise graphs off for every multimodal model), 8 MiB per captured size
        reserved += len(server_args.piecewise_token_sizes(chunk)) * 8
    return round((H200_MIB - reserved) / H200_MIB, 3) * server_args.vlm_mem_factor(shape.vision)


def _rest_gib(shape: capacity.ModelShape, flags: dict, version: str) -> float:
    """``_profile_available_bytes``: rest = post - pre * (1 - f), before the Mamba pool."""
    pre = H200_MIB / 1024 - STARTUP_USED_GIB
    if shape.multimodal and since(version, "0.5.17"):
        pre -= (1024 + 527) / 1024  # the tokenizer's CUDA-IPC feature pool and CUDA context
    rest = pre * fraction(shape, flags, version) - shape.pre_load_gib - shape.weights_gib \
        - shape.unexplained_gib
    if "speculative-algorithm" in flags and since(version, "0.5.17"):
        rest -= shape.draft_load_gib  # Scheduler.init_memory_pools: after the draft loaded
    if shape.multimodal and since(version, "0.5.18"):
        rest -= 100 / 1024  # mm_runtime_reservation_gb: SGLANG_VLM_CACHE_SIZE_MB = 100
    return rest


def expected(shape: capacity.ModelShape, flags: dict, version: str, ratio: int) -> tuple:
    """(slots, KV tokens, cap) for a hybrid model, by each release's source formulas."""
    f = EngineFlags.from_flags(flags, ENV, None, version)
    per = capacity.mamba_bytes_per_slot(shape, f)
    cell = capacity.kv_cell_bytes(shape, f)
    spec = "speculative-algorithm" in flags
    rest = _rest_gib(shape, flags, version)
    draft = 4 if spec else 0
    cli = flags.get("max-running-requests", 48 if spec else None)
    given = flags.get("max-mamba-cache-size")
    full = flags.get("mamba-full-memory-ratio", 0.9)
    r = ratio
    if not since(version, "0.5.13"):
        # 0.5.10-0.5.12: per_req * max_running_requests * D, before the slots
        if spec:
            rest -= per * cli * draft / GIB
        slots = given if given is not None else int(rest * full / (1 + full) * GIB // per)
        rest -= slots * per / GIB
    else:
        one = 1 if since(version, "0.5.17") else 0  # 0.5.17: the pool's padding slot
        if given is not None:
            slots = given
            if spec:
                rest -= per * (min(cli, slots // r) + one) * draft / GIB
        else:
            budget = rest * full / (1 + full) * GIB
            if spec:
                # (K + 1) * per + (K / R + 1) * D * per = budget (0.5.17); no +1 in 0.5.13
                slots = int((budget - one * per * (1 + draft)) // (per * (1 + draft / r)))
                rest -= per * (min(cli, slots // r) + one) * draft / GIB
            else:
                slots = int((budget - one * per) // per)
        rest -= (slots + one) * per / GIB
    tokens = int(rest * GIB) // int(cell)
    estimated = min(max(int(tokens / 8192 * 512), 2048), 4096)
    if cli is None:
        cap = min(estimated, tokens // 2)
    elif since(version, "0.5.14"):
        cap = min(cli, tokens // 2)  # _resolve_max_num_reqs from 0.5.14
    else:
        cap = min(cli, estimated)
    return slots, tokens, min(cap, slots // r)


@pytest.mark.parametrize("version", KNOWN)
def test_the_27b_baseline_in_each_release(version: str) -> None:
    got = plan(QWEN36, BASELINE, version)
    # extra_buffer with overlap (spec v2, topk 1): 3 + 2 ping-pong slots in every release
    assert got.mamba_ratio == 5
    assert (got.max_mamba_cache_size, got.max_total_num_tokens, got.max_running_requests) == \
        expected(QWEN36, BASELINE, version, 5)
    assert got.max_running_requests == 16  # 80 // 5, below the 48 default
    assert got.sglang_version == version


def test_from_0_5_13_the_baseline_reserves_draft_states_for_16_requests_not_48() -> None:
    per = capacity.mamba_bytes_per_slot(QWEN36, EngineFlags())
    cell = capacity.kv_cell_bytes(QWEN36, EngineFlags())
    old, new = plan(QWEN36, BASELINE, "0.5.12.post1"), plan(QWEN36, BASELINE, "0.5.13")
    # min(48, 80 // 5) = 16: (48 - 16) * 4 states fewer, all of them KV
    assert new.max_total_num_tokens - old.max_total_num_tokens == pytest.approx(
        (48 - 16) * 4 * per / cell, abs=1)


@pytest.mark.parametrize("version", KNOWN)
def test_the_27b_tuned_flags_in_each_release(version: str) -> None:
    got = plan(QWEN36, TUNED, version)
    assert got.mamba_ratio == 5 and got.max_running_requests == 40  # min(40, 200 // 5)
    assert (got.max_mamba_cache_size, got.max_total_num_tokens, got.max_running_requests) == \
        expected(QWEN36, TUNED, version, 5)


def test_0_5_17_charges_one_request_and_the_padding_slot_more_0_5_18_the_vlm_cache() -> None:
    per = capacity.mamba_bytes_per_slot(QWEN36, EngineFlags())
    cell = capacity.kv_cell_bytes(QWEN36, EngineFlags())
    t16, t17, t18 = (plan(QWEN36, TUNED, v).max_total_num_tokens
                     for v in ("0.5.16", "0.5.17", "0.5.18"))
    # (40+1)*4 and 200+1; the draft loaded first; the tokenizer's IPC pool and context
    # (1,551 MiB less `pre`, at the flag's fraction 0.93)
    first = QWEN36.draft_load_gib * GIB + 1551 * 2**20 * 0.93
    assert t16 - t17 == pytest.approx(((4 + 1) * per + first) / cell, abs=2)
    assert t17 - t18 == pytest.approx(100 * 2**20 / cell, abs=1)


@pytest.mark.parametrize("version", KNOWN)
def test_the_27b_with_auto_strategy_and_no_speculation(version: str) -> None:
    got = plan(QWEN36, CTX, version)
    # auto: no_buffer (3) through 0.5.13; extra_buffer with overlap (5) from 0.5.14
    ratio = 5 if since(version, "0.5.14") else 3
    assert got.mamba_ratio == ratio
    assert got.overlap_schedule is since(version, "0.5.14")
    assert (got.max_mamba_cache_size, got.max_total_num_tokens, got.max_running_requests) == \
        expected(QWEN36, CTX, version, ratio)


@pytest.mark.parametrize("version", KNOWN)
def test_a_dense_model_s_explicit_cap(version: str) -> None:
    unset, explicit = plan(DENSE, CTX, version), plan(DENSE, {**CTX, "max-running-requests": 6000},
                                                     version)
    tokens = unset.max_total_num_tokens
    assert explicit.max_total_num_tokens == tokens  # no release changes a dense pool here
    estimated = min(max(int(tokens / 8192 * 512), 2048), 4096)
    assert unset.max_running_requests == min(estimated, tokens // 2)
    if since(version, "0.5.14"):
        assert explicit.max_running_requests == min(6000, tokens // 2) == 6000
    else:
        assert explicit.max_running_requests == min(6000, estimated) == 4096


@pytest.mark.parametrize("version", KNOWN)
def test_flag_rules_that_moved(version: str) -> None:
    def ratio(flags: dict, env: dict | None = None) -> int:
        return server_args.mamba_ratio(EngineFlags.from_flags(flags, env or {}, None, version))

    eb = {"mamba-scheduler-strategy": "extra_buffer"}
    # SGLANG_ENABLE_SPEC_V2=0 turns spec v2 and so overlap off through 0.5.13 only
    v1 = ratio({**SPEC}, {"SGLANG_ENABLE_SPEC_V2": "0"})
    assert v1 == (5 if since(version, "0.5.14") else 4)
    # SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1 lowers the base 3 by one from 0.5.17
    skip = ratio(eb, {"SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK": "1"})
    assert skip == (4 if since(version, "0.5.17") else 5)
    assert ratio({"mamba-scheduler-strategy": "no_buffer"},
                 {"SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK": "1"}) == 3
    # auto under NGRAM: the Mamba rule runs before NGRAM turns overlap off, so from 0.5.14
    # extra_buffer without overlap (3 + 1); no_buffer (3) before
    ngram = {"speculative-algorithm": "NGRAM", "speculative-num-draft-tokens": 4}
    assert ratio(ngram) == (4 if since(version, "0.5.14") else 3)
    if since(version, "0.5.13"):  # extra_buffer_lazy: one ping-pong slot
        assert ratio({"mamba-scheduler-strategy": "extra_buffer_lazy"}) == 4
    # extra_buffer without the radix cache: refused through 0.5.13, R = 1 from 0.5.14
    no_radix = EngineFlags.from_flags({**eb, "disable-radix-cache": True}, {}, None, version)
    if since(version, "0.5.14"):
        launch_refusals.check_hybrid_flags(no_radix)
        assert server_args.mamba_ratio(no_radix) == 1
    else:
        with pytest.raises(ValueError, match="extra_buffer"):
            launch_refusals.check_hybrid_flags(no_radix)
    # A 32 GiB GPU: (2048, 24) through 0.5.19, (4096, 48) from 0.5.20
    chunk, graph, _ = server_args.derived_defaults(32 * 1024, EngineFlags.from_flags(
        {}, {}, None, version))
    assert (chunk, graph) == ((4096, 48) if since(version, "0.5.20") else (2048, 24))


def test_later_releases_flag_names_are_read() -> None:
    flags = EngineFlags.from_flags({"--mamba-radix-cache-strategy": "extra_buffer",
                                    "cuda-graph-max-bs-decode": 96}, {}, None, "0.5.23")
    assert (flags.mamba_scheduler_strategy, flags.cuda_graph_max_bs) == ("extra_buffer", 96)


def test_a_release_older_than_the_range_plans_as_the_oldest() -> None:
    for version in ("0.5.9", "nonsense"):
        assert server_args.release(EngineFlags(sglang_version=version)).version == "0.5.10.post1"


def _sim_caps(tmp_path: Path, argv: list[str], version: str) -> tuple[dict, dict]:
    sim = launch(tmp_path, argv, {"FLEET_SIM_SGLANG_VERSION": version},
                 log_name=f"sim-{version}.log")
    try:
        sim.wait_ready()
        return sim.get("/v1/loads").json(), sim.get("/server_info").json()
    finally:
        sim.stop()


def test_the_sim_plays_each_release_s_caps(tmp_path: Path) -> None:
    """The same flags, 0.5.11 and 0.5.23: each cap in /v1/loads as that release derives it."""
    argv = ["--model-path", str(MODELS / "qwen36-27b-dummy"), "--context-length", "8192"]
    caps = {}
    for version, ratio in (("0.5.11", 3), ("0.5.23", 5)):
        loads, info = _sim_caps(tmp_path, argv, version)
        state = info["internal_states"][0]
        slots, tokens = state["max_mamba_cache_size"], info["max_total_num_tokens"]
        estimated = min(max(int(tokens / 8192 * 512), 2048), 4096)
        caps[version] = loads["loads"][0]["max_running_requests"]
        assert caps[version] == min(estimated, tokens // 2, slots // ratio)
        assert info["version"] == version
    assert caps["0.5.11"] != caps["0.5.23"]
    dense = ["--model-path", str(MODELS / "llama31-8b-shape"), "--context-length", "8192",
             "--max-running-requests", "6000"]
    assert [_sim_caps(tmp_path, dense, v)[0]["loads"][0]["max_running_requests"]
            for v in ("0.5.11", "0.5.23")] == [4096, 6000]


def test_0_5_17_keeps_prefill_graphs_by_model_class() -> None:
    """0.5.17 ``_apply_cuda_graph_compatibility``: breakable prefill graphs for text models the
    0.5.11 list turned off (Qwen3-Next), for the two Qwen3.5 multimodal architectures; none for
    MLA other than DSA, Nemotron-H, other multimodal models, or with the flag."""
    def on(shape: capacity.ModelShape, version: str, flags: dict | None = None) -> bool:
        return server_args.piecewise_cuda_graph(
            EngineFlags.from_flags(flags or CTX, {}, None, version), shape)

    other_vlm = dataclasses.replace(QWEN36, architecture="Qwen3VLForConditionalGeneration")
    cases = {  # name: (shape, 0.5.11, 0.5.17)
        "llama": (DENSE, True, True),
        "qwen3.5 vlm": (QWEN36, False, True),
        "qwen3-vl": (other_vlm, False, False),
        "qwen3-next": (model_shape(str(MODELS / "qwen3next-tiny")), False, True),
        "deepseek-v2 mla": (model_shape(str(MODELS / "deepseek-v2-lite")), True, False),
        "nemotron-h": (model_shape(str(MODELS / "nemotron-h-8b")), True, False),
    }
    for name, (shape, old, new) in cases.items():
        assert (on(shape, "0.5.11"), on(shape, "0.5.17")) == (old, new), name
    assert not on(QWEN36, "0.5.17", {**CTX, "disable-piecewise-cuda-graph": True})
    # the reserve: 58 sizes up to the 8192 chunk, 8 MiB each, in the Qwen3.5 fraction
    f16, f17 = (plan(QWEN36, CTX, v).mem_fraction_static for v in ("0.5.16", "0.5.17"))
    assert round(f16 / server_args.vlm_mem_factor(QWEN36.vision), 3) == round(
        (H200_MIB - 512 - 8192 * 1.5 - 128 - 512) / H200_MIB, 3)
    assert round(f17 / server_args.vlm_mem_factor(QWEN36.vision), 3) == round(
        (H200_MIB - 512 - 8192 * 1.5 - 128 - 512 - 58 * 8) / H200_MIB, 3)


def test_0_5_17_a_multimodal_model_s_tokenizer_holds_gpu_memory_before_pre() -> None:
    """``_handle_multimodal_feature_transport``: cuda_ipc unless ``--mm-feature-transport cpu``;
    the pool (SGLANG_MM_FEATURE_CACHE_MB, 1024) and the tokenizer process's CUDA context."""
    total = H200_MIB / 1024 - STARTUP_USED_GIB
    assert plan(QWEN36, CTX, "0.5.17").free_before_weights_gib == pytest.approx(
        total - (1024 + 527) / 1024)
    for shape, flags, version in ((QWEN36, {**CTX, "mm-feature-transport": "cpu"}, "0.5.17"),
                                  (QWEN36, CTX, "0.5.16"), (DENSE, CTX, "0.5.17")):
        assert plan(shape, flags, version).free_before_weights_gib == pytest.approx(total)


def test_0_5_17_sizes_the_pools_after_the_draft_loaded() -> None:
    """``Scheduler.init_memory_pools`` after the draft worker: with the fraction pinned, the
    KV pool is the draft's loaded weights smaller than without speculation's other terms."""
    pinned = {**BASELINE, "mem-fraction-static": 0.85, "mm-feature-transport": "cpu"}
    t16, t17 = (plan(QWEN36, pinned, v).max_total_num_tokens for v in ("0.5.16", "0.5.17"))
    per = capacity.mamba_bytes_per_slot(QWEN36, EngineFlags())
    cell = capacity.kv_cell_bytes(QWEN36, EngineFlags())
    # and 0.5.17's one request (+1) and padding slot more: (16 + 1) * 4 states and 80 + 1 slots
    gone = QWEN36.draft_load_gib * GIB + (4 + 1) * per
    assert t16 - t17 == pytest.approx(gone / cell, abs=2)


@pytest.mark.parametrize("version", KNOWN)
@pytest.mark.parametrize("shape", [DENSE, QWEN36], ids=["dense", "qwen36"])
def test_disable_cuda_graph_drops_the_decode_graph_reserve_from_0_5_17(version, shape) -> None:
    """``reserve_for_graph_mb`` (0.5.17) adds the decode graphs' ``cuda_graph_max_bs * 2`` MiB
    only while the decode backend is on, and ``--disable-cuda-graph`` turns both phases off;
    through 0.5.16 ``_handle_gpu_memory_settings`` always added it. The real 0.5.17 engine gave
    Falcon-H1-7B under ``--disable-cuda-graph`` ``mem_fraction_static=0.91`` where the always-on
    term makes 0.907 (tests/test_real_pools.py)."""
    base = {**CTX, "disable-piecewise-cuda-graph": True}
    on = EngineFlags.from_flags(base, ENV, version=version)
    off = EngineFlags.from_flags({**base, "disable-cuda-graph": True}, ENV, version=version)
    chunk, graph_bs, _ = server_args.derived_defaults(H200_MIB, on, shape)
    kept = server_args.reserved_mib(chunk, graph_bs, on, H200_MIB, shape)
    dropped = server_args.reserved_mib(chunk, graph_bs, off, H200_MIB, shape)
    assert dropped >= 10240  # above the reserve's floor: the difference is the term itself
    assert kept - dropped == (graph_bs * 2 if since(version, "0.5.17") else 0)
    plan = capacity.plan_capacity(shape, off, H200_MIB)
    assert (plan.cuda_graph_gib == 0) == since(version, "0.5.17")
