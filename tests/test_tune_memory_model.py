"""The memory model calibrated from real SGLang 0.5.11 on an H200 (tests/fixtures/sglang/0.5.11/
real-h200/: the 27B-shaped hybrid with MTP) and from a hand-made B200 snapshot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config.launch_profile import load_profile
from workers.engine import model_config
from workers.engine.log import parse_log
from workers.tune import snapshot
from workers.tune.flags import apply_changes
from workers.tune.memory_model import CannotPlan, DoesNotFit, calibrate, config_model

FIXTURES = Path(__file__).parent / "fixtures"
REAL = FIXTURES / "sglang" / "0.5.11" / "real-h200"
BASELINE = FIXTURES / "tune" / "snapshots" / "baseline_mamba_slots"
MODEL = "/tmp/rsg/models/qwen36-27b-dummy"  # the path the real engine ran; not on this machine
H200_MIB = 143_771
B200_MIB = 183_359
MIB = 2**20


@pytest.fixture(autouse=True)
def _model_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    # A snapshot's model-path is on the engine's node: its config.json is found by folder name.
    dirs = [FIXTURES / "models", model_config.REPO_CONFIGS]
    monkeypatch.setattr(model_config, "CONFIG_DIRS", dirs)


def _profile(name: str) -> dict:
    return {**load_profile(name).flags, "model-path": MODEL}


def _real(stage: str) -> tuple[dict, object]:
    text = (REAL / stage / "04_before_server_info.txt").read_text()
    info = json.loads(text[text.index("{"):])
    return info, parse_log((REAL / stage / "server.log").read_text())


def _calibrated(stage: str = "big80", profile: str = "qwen36-27b-baseline"):
    info, log = _real(stage)
    env = load_profile(profile).env
    return calibrate(_profile(profile), H200_MIB, log, info, env)


def test_calibration_reads_the_free_memory_the_weights_and_per_slot_costs_from_the_log():
    model = _calibrated()
    measured = {m.name: m.value for m in model.measured}
    assert measured["free_before_weights_gib"] == 139.13  # Load weight begin. avail mem=
    assert measured["weights_gib"] == pytest.approx(139.13 - 88.23)  # begin - end avail mem
    assert measured["draft_weights_gib"] == 5.52  # the draft's transient load
    # 11.39 GB of SSM state for 81 states plus 9.56 GB for 17 x 4 speculative states.
    assert measured["mamba_ssm_bytes_per_slot"] / MIB == pytest.approx(144.0, abs=0.1)
    assert measured["mamba_conv_bytes_per_slot"] / MIB == pytest.approx(2.81, abs=0.03)
    assert measured["kv_bytes_per_token"] == pytest.approx(32 * 1024, abs=2)
    # SGLang's own arithmetic from the logged free memory leaves only the log's rounding.
    assert abs(measured["unattributed_gib"]) < 0.025
    assert not [u for u in model.unread if "free memory before" in u]


def test_it_reproduces_the_baseline_80_slots_16_running_and_its_mamba_sizes():
    pred = _calibrated().predict(_profile("qwen36-27b-baseline"))
    assert pred.cap == 16 and pred.plan.mamba_ratio == 5
    assert pred.plan.max_mamba_cache_size == 80
    assert pred.plan.max_total_num_tokens == pytest.approx(755_549, abs=2)
    assert pred.plan.cli_max_running_requests == 48
    gib = {k: round(v, 2) for k, v in pred.mamba_gib.items()}
    assert gib == {
        "conv_state": 0.22,
        "ssm_state": 11.39,
        "intermediate_ssm_state_cache": 9.56,
        "intermediate_conv_window_cache": 0.19,
    }
    # 48 requests' speculative states and 80 slots reserved, 17 x 4 and 81 allocated.
    assert pred.plan.memory_gib["free"] == pytest.approx(123 * 0.14337, abs=0.05)


@pytest.mark.parametrize(("stage", "changes"), [
    ("big200_40", {"max-running-requests": 40}),
    ("big200", {"max-running-requests": 64}),
])
def test_calibrated_at_80_slots_it_predicts_the_real_200_slot_launches(stage, changes):
    """Measured on the baseline, predicted for the tuned flags: what the real engine did."""
    flags = apply_changes(_profile("qwen36-27b"), changes)
    pred = _calibrated().predict(flags)
    real = _real(stage)[1]
    assert pred.cap == real.scheduler.max_running_requests == 40
    assert pred.plan.max_total_num_tokens == pytest.approx(
        real.scheduler.max_total_num_tokens, rel=0.002)
    for name, gb in (("conv_state", 0.55), ("ssm_state", 28.27),
                     ("intermediate_ssm_state_cache", 23.06),
                     ("intermediate_conv_window_cache", 0.45)):
        assert pred.mamba_gib[name] == pytest.approx(gb, abs=0.011), name


@pytest.mark.parametrize(
    ("changes", "ratio", "cap"),
    [
        ({}, 5, 16),  # extra_buffer with overlap (spec v2)
        ({"disable-overlap-schedule": True}, 4, 20),  # extra_buffer without overlap
        ({"disable-radix-cache": True, "mamba-scheduler-strategy": None}, 1, 48),  # 48 default
        (
            {
                "disable-radix-cache": True,
                "mamba-scheduler-strategy": None,
                "max-running-requests": 80,
            },
            1,
            80,
        ),
    ],
)
def test_running_cap_follows_slots_over_r_for_each_cache_mode(changes, ratio, cap):
    flags = apply_changes(_profile("qwen36-27b-baseline"), changes)
    pred = _calibrated().predict(flags)
    assert (pred.plan.mamba_ratio, pred.cap) == (ratio, cap)


def test_no_buffer_without_speculation_costs_three_slots_per_request():
    flags = apply_changes(
        _profile("qwen36-27b-baseline"),
        {"speculative-algorithm": None, "mamba-scheduler-strategy": None},
    )
    pred = _calibrated().predict(flags)
    assert (pred.plan.mamba_ratio, pred.cap) == (3, 80 // 3)


def test_bf16_ssm_state_halves_the_ssm_memory_per_slot():
    flags = _profile("qwen36-27b")
    fp32 = _calibrated().predict(flags)
    bf16 = _calibrated().predict({**flags, "mamba-ssm-dtype": "bfloat16"})
    ratio = bf16.mamba_gib["ssm_state"] / fp32.mamba_gib["ssm_state"]
    assert ratio == pytest.approx(0.5, abs=0.01)
    assert bf16.plan.max_total_num_tokens > fp32.plan.max_total_num_tokens


def test_a_profile_that_does_not_fit_is_refused_with_sglangs_error():
    flags = {**_profile("qwen36-27b"), "max-mamba-cache-size": 2000}
    with pytest.raises(DoesNotFit, match="Not enough memory"):
        config_model(flags, H200_MIB).predict(flags)
    with pytest.raises(DoesNotFit, match="Not enough memory"):
        config_model(flags, 81_559).predict(_profile("qwen36-27b"))


def test_an_engine_whose_pools_lack_memory_gets_it_booked_and_its_own_tokens_reproduced():
    # Hand-made B200 snapshot: its KV line has ~10 GiB less than its own free-memory lines give.
    snap = snapshot.load(BASELINE)
    profile = load_profile("qwen36-27b-baseline")
    model = calibrate(profile.flags, B200_MIB, parse_log(snap["log"]), snap["server_info"],
                      profile.env)
    measured = {m.name: m.value for m in model.measured}
    assert measured["unattributed_gib"] == pytest.approx(10.15, abs=0.05)
    pred = model.predict(profile.flags)
    assert (pred.cap, pred.plan.max_total_num_tokens) == (16, pytest.approx(1_137_037, abs=2))


def test_a_model_whose_config_cannot_be_read_cannot_be_planned(tmp_path, monkeypatch):
    monkeypatch.setattr(model_config, "CONFIG_DIRS", [])
    with pytest.raises(CannotPlan, match=r"^cannot plan: .*no-such-model/config.json"):
        config_model({"model-path": str(tmp_path / "no-such-model")}, H200_MIB)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(CannotPlan, match=r"broken/config.json: key 'hidden_size' missing$"):
        config_model({"model-path": str(tmp_path / "broken")}, H200_MIB)
