"""Launches SGLang 0.5.11 refuses by rule, found before the launch; SGLang's words after one.

The rules are read from SGLang's ``server_args.py`` (``_handle_model_specific_adjustments``,
``_handle_mamba_radix_cache``), ``layers/linear.py`` and ``configs/mamba_utils.py``; the
Nemotron-H refusal and its assertion line are the real engine's
(tests/fixtures/sglang/0.5.11/real-h200/nemotron_h_triton/server.log).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from config.launch_profile import LaunchProfile
from workers.engine.capacity import EngineFlags, conv_bytes_per_slot, plan_capacity
from workers.engine.launch_refusals import LaunchRefused, known_refusals
from workers.engine.lifecycle import Engine, EngineSpec, prelaunch_refusals, start_failure
from workers.engine.model_config import model_shape
from workers.errors import EngineStartFailed

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = FIXTURES / "models"
REAL = FIXTURES / "sglang" / "0.5.11" / "real-h200"
H200_MIB = 143_771


def _refusals(model: str, **flags: object) -> list[str]:
    shape = model_shape(str(MODELS / model))
    return [str(r) for r in known_refusals(shape, EngineFlags.from_flags(flags))]


def test_each_rule_names_sglangs_reason_and_where() -> None:
    (nemo,) = _refusals("nemotron-h-8b", attention_backend="triton")
    assert "does not support triton attention backend" in nemo
    assert "server_args.py::ServerArgs._handle_model_specific_adjustments" in nemo
    assert _refusals("nemotron-h-8b", attention_backend="fa3") == []
    (extra,) = _refusals("falcon-h1-7b", mamba_scheduler_strategy="extra_buffer")
    assert "extra_buffer is not supported for FalconH1ForCausalLM" in extra
    # 0.5.14 supports extra_buffer for Falcon-H1 (_support_mamba_cache_extra_buffer).
    assert _refusals("falcon-h1-7b", mamba_scheduler_strategy="extra_buffer",
                     sglang_version="0.5.14") == []
    (oss,) = _refusals("gpt-oss-20b", attention_backend="flashinfer")
    assert "GptOssForCausalLM requires one of" in oss
    assert _refusals("gpt-oss-20b", attention_backend="triton") == []
    # 12 attention heads, 2 KV heads, 24 Mamba heads: tp 5 divides none of them.
    found = _refusals("falcon-h1-7b", tp_size=5)
    assert len(found) == 3 and "24 Mamba heads" in found[2]
    assert any("12 attention heads" in r for r in _refusals("falcon-h1-7b", tp_size=8))
    assert _refusals("falcon-h1-7b", tp_size=2) == []


def test_plan_capacity_refuses_what_the_real_engine_refused() -> None:
    shape = model_shape(str(MODELS / "nemotron-h-8b"))
    with pytest.raises(LaunchRefused, match="triton"):
        plan_capacity(shape, EngineFlags.from_flags({"attention-backend": "triton"}), H200_MIB)
    plan = plan_capacity(shape, EngineFlags.from_flags({"attention-backend": "fa3"}), H200_MIB)
    assert plan.max_running_requests == plan.max_mamba_cache_size // 3  # no_buffer, radix on


def test_tp_pads_mamba2_groups_in_the_conv_state() -> None:
    """n_groups 1 at tp 2 is padded to 2 groups (configs/mamba_utils.py::
    extra_groups_for_head_shards): the conv state per GPU is (3072 + 2 x 2 x 256) / 2 x 3."""
    shape = model_shape(str(MODELS / "falcon-h1-7b"))
    per_gpu = conv_bytes_per_slot(shape, EngineFlags.from_flags({"tp-size": 2}))
    assert per_gpu == 44 * (3072 + 2 * 2 * 256) // 2 * 3 * 2


def _spec(tmp_path: Path, model: str, **flags: object) -> EngineSpec:
    profile = LaunchProfile(name="t", flags={"model-path": str(MODELS / model), **flags})
    return EngineSpec(kind="sglang", profile=profile, gpu=0, host="127.0.0.1", port=1,
                      log_path=tmp_path / "engine.log")


def test_the_worker_refuses_before_it_launches(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "nemotron-h-8b", **{"attention-backend": "triton"})
    assert prelaunch_refusals(spec)
    engine = Engine(spec)
    with pytest.raises(EngineStartFailed, match="not started: SGLang refuses this launch: "
                       "NemotronHForCausalLM does not support triton"):
        engine.start()
    assert engine.pid is None
    assert prelaunch_refusals(_spec(tmp_path, "falcon-h1-7b",
                                    **{"attention-backend": "triton"})) == []


def test_the_start_error_quotes_sglangs_last_error_and_hint(tmp_path: Path) -> None:
    assert start_failure(REAL / "nemotron_h_triton" / "server.log") == (
        "AssertionError: NemotronHForCausalLM does not support triton attention backend,as "
        "the first layer might not be an attention layer")
    log = tmp_path / "engine.log"
    log.write_text(
        "[2026-12-01 20:00:00] Piecewise CUDA Graph failed with error: boom\n"
        "Piecewise CUDA Graph is enabled by default as an experimental feature.\n"
        "To work around this error, add --disable-piecewise-cuda-graph to your launch command.\n"
        "Please report this issue at https://github.com/sgl-project/sglang/issues/new/choose\n"
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "RuntimeError: boom\n")
    spec = _spec(tmp_path, "falcon-h1-7b")
    engine = Engine(spec)
    engine._proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    engine._proc.wait()
    with pytest.raises(EngineStartFailed) as err:
        engine.wait_ready(5)
    assert str(err.value) == (
        f"engine on GPU 0 exited with code 1 while starting: RuntimeError: boom; SGLang's "
        f"hint: add --disable-piecewise-cuda-graph; see {log}")


def test_the_tuners_levers_for_a_mamba2_hybrid_are_what_a_relaunch_admits() -> None:
    """Falcon-H1-7B on one H200 (0.5.11): no_buffer under the radix cache (R = 3, the real
    engine's 405 slots -> cap 135), more slots sized slots = cap x 3, no radix (R = 1) and bf16
    SSM each re-predicted; extra_buffer is SGLang's refusal, not an option."""
    from workers.tune.kv_floor import need_from_lengths
    from workers.tune.levers import Situation, running_cap_options
    from workers.tune.memory_model import DoesNotFit, config_model
    from workers.tune.throughput import WORKLOAD

    flags = {"model-path": str(MODELS / "falcon-h1-7b"), "context-length": 8192,
             "attention-backend": "triton", "disable-piecewise-cuda-graph": True}
    model = config_model(flags, H200_MIB)
    base = model.predict(flags)
    assert (base.plan.max_mamba_cache_size, base.cap) == (405, 135)
    with pytest.raises(DoesNotFit, match="extra_buffer is not supported"):
        model.predict({**flags, "mamba-scheduler-strategy": "extra_buffer"})
    sit = Situation(flags=flags, current_cap=base.cap, context_len=8192,
                    kv_need=need_from_lengths(500, 1000, None, 8192), cache_hit_rate=0.0,
                    prefill_share=0.3, fraction=base.plan.mem_fraction_static,
                    extra_fraction=0.0, throughput=WORKLOAD)
    options = {o.name: o for o in running_cap_options(model, sit)}
    for name, ratio in (("more_slots", 3), ("no_radix", 1), ("more_slots+bf16_ssm", 3)):
        option = options[name]
        assert option.prediction is not None, name
        assert option.changes["max-mamba-cache-size"] == option.cap * ratio
        relaunch = model.predict({**flags, **option.changes})
        assert (relaunch.cap, relaunch.plan.max_mamba_cache_size) == (
            option.cap, option.cap * ratio)
    assert options["no_radix"].cap > options["more_slots"].cap


def test_the_conv_state_follows_sglang_mamba_conv_dtype() -> None:
    shape = model_shape(str(MODELS / "falcon-h1-7b"))
    bf16 = conv_bytes_per_slot(shape, EngineFlags.from_flags({}))
    fp32 = conv_bytes_per_slot(shape, EngineFlags.from_flags(
        {}, env={"SGLANG_MAMBA_CONV_DTYPE": "float32"}))
    assert (bf16, fp32) == (44 * 3584 * 3 * 2, 44 * 3584 * 3 * 4)
