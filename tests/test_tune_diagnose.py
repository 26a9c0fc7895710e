"""``diagnose`` on hand-made snapshots in SGLang's real formats, one per binding constraint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workers.tune import snapshot
from workers.tune.diagnose import diagnose
from workers.tune.situation import InsufficientEvidence

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "tests" / "fixtures" / "tune" / "snapshots"


def _diagnose(name: str, **changes: object) -> dict:
    snap = snapshot.load(SNAPSHOTS / name)
    snap.update(changes)
    return diagnose(snap).to_json()


def _evidence(d: dict) -> dict[str, tuple[object, str]]:
    return {e["name"]: (e["value"], e["source"]) for e in d["evidence"]}


def test_workload_baseline_is_capped_by_mamba_slots_over_r():
    d = _diagnose("baseline_mamba_slots")
    assert (d["binding_constraint"], d["cause"]) == ("running_cap", "mamba_slots")
    ev = _evidence(d)
    assert ev["running"] == (16, "metrics sglang:num_running_reqs")
    assert ev["queued"] == (32, "metrics sglang:num_queue_reqs")
    assert (
        ev["effective_cap"][0] == 16 and "effective_max_running_requests" in ev["effective_cap"][1]
    )
    assert ev["cli_max_running_requests"][0] == 48  # the CLI value, not the cap
    assert ev["mamba_slots"] == (80, "log Mamba Cache is allocated max_mamba_cache_size")
    assert ev["mamba_ratio"][0] == 5
    # The full-KV pool (used / capacity tokens), not token_usage 0.74 (= mamba usage there).
    assert ev["kv_usage"] == (
        0.0251, "metrics sglang:num_used_tokens / sglang:max_total_num_tokens"
    )
    assert ev["gpu_memory_free_mib"][0] == 27024
    assert ev["stranded_gib"][0] == pytest.approx(17.63, abs=0.01)
    assert any("utilisation 91%" in n for n in d["notes"])


def test_baseline_recommendation_raises_the_cap_without_a_lossy_lever():
    d = _diagnose("baseline_mamba_slots")
    rec = d["recommendation"]
    # Prompts share 0.8 % of their tokens: R = 1 beats more slots at R = 5.
    assert rec["chosen"] == "no_radix"
    assert rec["flags"]["disable-radix-cache"] is True
    assert rec["flags"]["mamba-scheduler-strategy"] is None  # extra_buffer needs the radix cache
    n = rec["flags"]["max-running-requests"]
    assert n == rec["flags"]["max-mamba-cache-size"] == rec["predicted"]["max_running_requests"]
    assert 60 <= n <= 120
    assert rec["client_concurrency"] == -(-n * 5 // 4) + 1
    predicted = rec["predicted"]
    # No job record in this snapshot: every request is taken to run to the context (the
    # conservative bound, never what requests held at the snapshot), and the pool must admit
    # n of those by SGLang's own arithmetic (PrefillAdder at the decayed new_token_ratio).
    need = _evidence(d)["kv_need_per_request"]
    assert need[1].startswith("context:") and "--context-length 8,192" in need[1]
    chosen = next(o for o in rec["options"] if o["name"] == rec["chosen"])
    assert chosen["kv_holds_requests"] >= n == chosen["effective_running"]
    assert n * need[0] <= predicted["kv_tokens"]
    assert predicted["memory_gb"]["free"] == 0.0  # nothing stranded once the cap is explicit
    memory = predicted["memory_gb"]
    parts = ("weights", "mamba", "mamba_intermediate", "kv", "unexplained", "draft", "reserved",
             "free")
    assert sum(memory[k] for k in parts) == pytest.approx(memory["total"], abs=0.05)
    options = {o["name"]: o for o in rec["options"]}
    keep = options["more_slots"]["predicted"]
    assert keep["mamba_ratio"] == 5 and keep["mamba_slots"] == 5 * keep["max_running_requests"]
    assert keep["max_running_requests"] < n
    bf16 = options["no_radix+bf16_ssm"]
    assert bf16["lossy"] and bf16["predicted"]["max_running_requests"] > n
    reasons = " ".join(rec["reasons"])
    assert "--disable-radix-cache" in reasons and "bfloat16" in reasons
    assert "accuracy trade-off" in reasons and "48" in reasons


def test_underscore_spelled_metrics_give_the_same_diagnosis():
    snap = snapshot.load(SNAPSHOTS / "baseline_mamba_slots")
    snap["metrics"] = snap["metrics"].replace("sglang:", "sglang_")
    d = diagnose(snap).to_json()
    assert (d["binding_constraint"], d["cause"]) == ("running_cap", "mamba_slots")
    assert _evidence(d)["running"] == (16, "metrics sglang_num_running_reqs")


def test_only_a_log_still_names_the_mamba_cap():
    snap = snapshot.load(SNAPSHOTS / "baseline_mamba_slots")
    d = diagnose({"log": snap["log"]}, gpu_memory_mib=183_359).to_json()
    assert (d["binding_constraint"], d["cause"]) == ("running_cap", "mamba_slots")
    ev = _evidence(d)
    assert ev["running"] == (16, "log Decode batch #running-req")
    assert ev["effective_cap"] == (16, "log scheduler max_running_requests=")
    # Without cache counters the radix cache stays (R = 5): lossless, 51 running fit (no job
    # record: the pool must admit that many requests running to the 8,192 context, by
    # SGLang's admission arithmetic); bf16 SSM state fits 92, but the log measured steady
    # state at 16 running only, so the gain of that accuracy trade-off is unmeasured: it is
    # named, the lossless lever is chosen.
    rec = d["recommendation"]
    options = {o["name"]: o for o in rec["options"]}
    assert options["more_slots"]["predicted"]["max_running_requests"] == 51
    assert options["more_slots"]["kv_holds_requests"] >= 51
    assert not options["no_radix"]["eligible"]
    assert options["more_slots+bf16_ssm"]["predicted"]["max_running_requests"] == 92
    assert rec["chosen"] == "more_slots"
    assert rec["predicted"]["max_running_requests"] == 51
    assert rec["flags"].get("mamba-ssm-dtype") is None
    bf16 = next(r for r in rec["reasons"] if "bfloat16" in r)
    assert "92 running" in bf16 and "unmeasured" in bf16 and "not chosen" in bf16


def _earlier_start(cap: int, tok_s: float) -> str:
    """An earlier start as ``tune snapshot`` keeps it: at its cap with a queue."""
    scheduler = (
        f"[2026-05-06 10:00:00] max_total_num_tokens=1137037, chunked_prefill_size=16384, "
        f"max_prefill_tokens=16384, max_running_requests={cap}, context_len=8192, "
        f"available_gpu_mem=20.00 GB\n"
    )
    decode = (
        f"[2026-05-06 10:10:00] Decode batch, #running-req: {cap}, #full token: {cap * 1800}, "
        f"full token usage: 0.05, mamba num: {cap * 4}, mamba usage: 0.80, accept len: 3.50, "
        f"accept rate: 0.83, cuda graph: True, gen throughput (token/s): {tok_s:.2f}, "
        f"#queue-req: 30\n"
    )
    return "[2026-05-06 09:58:00] Load weight begin. avail mem=178.52 GB\n" + scheduler + decode * 3


def test_a_measured_curve_lets_a_lossy_lever_win_by_its_margin():
    # Canary starts at 40 and 80 running on the observed run's curve (7,000 * n / (n + 40)),
    # with the baseline's 16: three steady counts over 5x measure the knee (120). Then bf16
    # SSM state's 92 running beat the lossless 51 by more than the 20 % bar.
    snap = snapshot.load(SNAPSHOTS / "baseline_mamba_slots")
    log = _earlier_start(40, 3500.0) + _earlier_start(80, 7000 * 80 / 120) + snap["log"]
    d = diagnose({"log": log, "profile": snap["profile"]}, gpu_memory_mib=183_359).to_json()
    assert _evidence(d)["throughput_half_n"][0] == pytest.approx(40, abs=1)
    rec = d["recommendation"]
    assert rec["chosen"] == "more_slots+bf16_ssm"
    assert rec["predicted"]["max_running_requests"] == 92
    assert any("chosen although lossy" in r for r in rec["reasons"])


def test_client_concurrency_when_the_engine_queue_is_empty():
    d = _diagnose("client_concurrency_underscore")
    assert (d["binding_constraint"], d["cause"]) == ("client_concurrency", "engine_queue_empty")
    ev = _evidence(d)
    assert ev["running"] == (24, "metrics sglang_num_running_reqs")
    assert ev["effective_cap"] == (40, "loads loads[].max_running_requests")
    assert d["recommendation"]["flags"] == {}
    assert d["recommendation"]["client_concurrency"] == 51


def test_speculative_default_of_48():
    d = _diagnose("speculative_default")
    assert (d["binding_constraint"], d["cause"]) == ("running_cap", "speculative_default")
    flags = d["recommendation"]["flags"]
    assert flags["max-running-requests"] > 48
    assert flags["max-mamba-cache-size"] == 5 * flags["max-running-requests"]


def test_explicit_flag():
    d = _diagnose("explicit_flag")
    assert (d["binding_constraint"], d["cause"]) == ("running_cap", "explicit_flag")
    assert _evidence(d)["gpu_memory_total_mib"][0] == 143771
    rec = d["recommendation"]
    assert rec["flags"]["max-running-requests"] > 24 * 1.1
    no_radix = next(o for o in rec["options"] if o["name"] == "no_radix")
    assert not no_radix["eligible"] and "hit rate is unknown" in no_radix["note"]


def test_kv_capacity_on_a_dense_model():
    d = _diagnose("kv_capacity_dense")
    assert (d["binding_constraint"], d["cause"]) == ("kv_capacity", "kv_pool_full")
    assert _evidence(d)["kv_usage"][0] == pytest.approx(0.96, abs=0.005)
    rec = d["recommendation"]
    assert rec["flags"] == {"kv-cache-dtype": "fp8_e4m3"}
    assert rec["predicted"]["kv_tokens"] == pytest.approx(2 * 1179124, abs=1)  # floor of 2x


def test_gpu_memory_when_no_lossless_lever_fits_more():
    d = _diagnose("gpu_memory_h100")
    assert (d["binding_constraint"], d["cause"]) == ("gpu_memory", "no_room_for_more_running")
    rec = d["recommendation"]
    assert rec["flags"]["mamba-ssm-dtype"] == "bfloat16"
    assert rec["predicted"]["max_running_requests"] > 16 * 1.1
    assert any("lossy" in r for r in rec["reasons"])


def test_compute_when_more_running_requests_stop_paying_off():
    d = _diagnose("compute_flat")
    assert (d["binding_constraint"], d["cause"]) == ("compute", "throughput_flat_in_running")
    assert d["recommendation"]["flags"] == {}
    assert "24->3420" in _evidence(d)["throughput_half_n"][1]


def test_without_running_and_queue_readings_diagnose_refuses():
    with pytest.raises(InsufficientEvidence, match="running"):
        diagnose({"gpu": {"memory_total_mib": 183359}})


def test_cli_json_contract_and_exit_code_2_on_missing_evidence(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "workers.tune",
            "diagnose",
            "--snapshot",
            str(SNAPSHOTS / "baseline_mamba_slots"),
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert {"binding_constraint", "cause", "evidence", "recommendation"} <= set(d)
    assert {"flags", "client_concurrency", "predicted"} <= set(d["recommendation"])
    predicted = d["recommendation"]["predicted"]
    assert {"max_running_requests", "mamba_slots", "kv_tokens", "memory_gb"} <= set(predicted)
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    bad = subprocess.run(
        [sys.executable, "-m", "workers.tune", "diagnose", "--snapshot", str(empty)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_metrics_alone_name_the_running_cap_and_list_what_would_sharpen_it():
    # A pasted /metrics: no NVML, no log, no /server_info, no profile.
    d = _diagnose("metrics_only")
    assert d["binding_constraint"] == "running_cap"
    assert d["recommendation"]["flags"] == {}
    assert "memory-fitting recommendation" in d["recommendation"]["reasons"][0]
    missing = " ".join(d["missing_evidence"])
    assert "GPU memory" in missing and "log" in missing and "/server_info" in missing
    ev = _evidence(d)
    assert ev["queued"][0] > 0 and ev["kv_usage"][0] < 0.1
    # The GPU's memory alone plans nothing: without a model-path there is no config.json to
    # size pools from (no placeholder model).
    snap = snapshot.load(SNAPSHOTS / "metrics_only")
    with pytest.raises(InsufficientEvidence):
        diagnose(snap, gpu_memory_mib=183_359)


def test_long_context_does_not_block_a_cap_sglang_would_serve():
    # The same engine with a 128k context running the workload's job (mean 2,490 output
    # tokens, max_new_tokens 7,000): SGLang admits on new_token_ratio and retracts when short,
    # so what the pool must hold is what this job's requests hold, not 128k each.
    snap = snapshot.load(SNAPSHOTS / "baseline_mamba_slots")
    snap["log"] = snap["log"].replace("context_len=8192", "context_len=131072")
    snap["profile"]["flags"]["context-length"] = 131072
    snap["job"] = {"name": "workload", "max_new_tokens": 7000, "output_tokens_mean": 2490,
                   "completed": 4000}
    d = diagnose(snap).to_json()
    rec = d["recommendation"]
    assert rec["predicted"]["max_running_requests"] > 16 * 2
    assert rec["predicted"]["kv_tokens"] < rec["predicted"]["max_running_requests"] * 131072
    assert _evidence(d)["kv_need_per_request"][1].startswith("job: job workload")
    # Without the job's lengths the 128k context is the bound, and the tuner says so.
    del snap["job"]
    d = diagnose(snap).to_json()
    assert "--context-length 131,072" in _evidence(d)["kv_need_per_request"][1]
