"""``diagnose`` on snapshots of real SGLang 0.5.11 on one H200 (the seed's baseline, the tuned
profile): the cap named, a recommendation that reaches the expert's 40 running, and no knee or
compute verdict drawn from warm-up lines.

The folders are built from the real captures by ``tests/fixtures/tune/snapshots/make_real.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

from workers.tune import snapshot
from workers.tune.diagnose import diagnose
from workers.tune.flags import apply_changes
from workers.tune.levers import NO_RADIX, SEARCH_STEP, _fits, running_cap_options
from workers.tune.situation import situation, view_from_snapshot

SNAPSHOTS = Path(__file__).parent / "fixtures" / "tune" / "snapshots"
BIG80 = SNAPSHOTS / "real_h200_big80"
BIG200_40 = SNAPSHOTS / "real_h200_big200_40"
# The expert's hand-tuned launch ran 40 at 200 slots on the same GPU (398 -> 649 tok/s).
EXPERT_RUNNING = 40


def _evidence(d: dict) -> dict[str, tuple[object, str]]:
    return {e["name"]: (e["value"], e["source"]) for e in d["evidence"]}


def _counts(source: str) -> set[float]:
    """The running counts a throughput model's source names (``16->439`` ...)."""
    return {float(n) for n in re.findall(r"(\d+(?:\.\d+)?)->\d", source)}


def _check_running_cap_recommendation(d: dict) -> dict:
    rec = d["recommendation"]
    predicted = rec["predicted"]
    n = predicted["max_running_requests"]
    assert n >= EXPERT_RUNNING
    flags = rec["flags"]
    assert flags["max-running-requests"] == n  # explicit: speculative decoding would reset to 48
    assert flags["max-mamba-cache-size"] == predicted["mamba_slots"] == n * predicted["mamba_ratio"]
    assert "mamba-ssm-dtype" not in flags  # lossless
    need = _evidence(d)["kv_need_per_request"][0]
    assert predicted["kv_tokens"] >= n * need
    reasons = " ".join(rec["reasons"])
    assert "knee" not in reasons.replace("no knee is claimed", "")
    assert "unmeasured" in reasons and "tune auto" in reasons and "rolls it back" in reasons
    return rec


def test_real_baseline_names_the_mamba_cap_and_reaches_the_experts_40():
    snap = snapshot.load(BIG80)
    d = diagnose(snap).to_json()
    assert (d["binding_constraint"], d["cause"]) == ("running_cap", "mamba_slots")
    ev = _evidence(d)
    assert ev["mamba_slots"] == (80, "log Mamba Cache is allocated max_mamba_cache_size")
    assert ev["running"][0] == 16 and ev["queued"][0] > 0 and ev["effective_cap"][0] == 16
    rec = _check_running_cap_recommendation(d)
    # The throughput model read the engine at its cap with a queue, not the capture's probes
    # (1 and 2 running) or the drain (8): the curve above 16 is unmeasured, and says so.
    value, source = ev["throughput_measured_up_to"]
    assert value == 16 and _counts(source) == {16}
    assert all(_counts(o["note"]) == set() for o in rec["options"])


def test_real_baseline_keeping_the_radix_cache_still_reaches_40():
    # Prompts sharing prefixes keep the radix cache (R = 5): the lever is more slots, and
    # memory (not an invented knee) sizes them, as the expert's 200 slots for 40 running.
    snap = snapshot.load(BIG80)
    prompt = re.search(r"^sglang:prompt_tokens_total\{([^}]*)\} (\S+)$", snap["metrics"], re.M)
    assert prompt is not None
    snap["metrics"] += (
        f'sglang:cached_tokens_total{{{prompt.group(1)},cache_source="device"}} '
        f"{float(prompt.group(2)) * 0.3}\n"
    )
    d = diagnose(snap).to_json()
    assert (d["binding_constraint"], d["cause"]) == ("running_cap", "mamba_slots")
    rec = _check_running_cap_recommendation(d)
    assert rec["chosen"].startswith("more_slots")
    assert rec["predicted"]["mamba_ratio"] == 5
    assert "disable-radix-cache" not in rec["flags"]


def test_each_lever_gets_the_largest_running_count_that_fits():
    # What fits is a band: with MTP the draft's KV pool is as many tokens as the target's, so
    # at NVML's raised fraction few running requests (a large pool) leave the draft no room
    # where more fit. Each lever's count is the brute-force largest, raised fraction or not.
    view = view_from_snapshot(snapshot.load(BIG80))
    sit = situation(view)
    assert sit.raised_fraction()
    options = {o.name: o for o in running_cap_options(view.model, sit)}
    assert {"more_slots+mem_fraction", "no_radix+mem_fraction"} <= set(options)
    for name, option in options.items():
        flags = apply_changes(sit.flags, {k: v for k, v in option.changes.items()
                                          if k not in ("max-running-requests",
                                                       "max-mamba-cache-size")})
        fitting = [n for n in range(1, 400) if _fits(view.model, flags, n, sit) is not None]
        assert fitting, name
        assert option.cap == max(fitting), name
    # The band: at the raised fraction a single request does not fit, the chosen count does.
    raised = apply_changes(sit.flags, {**NO_RADIX, **sit.raised_fraction()})
    assert _fits(view.model, raised, 1, sit) is None
    assert options["no_radix+mem_fraction"].cap >= EXPERT_RUNNING


def test_real_tuned_profile_is_not_called_compute_bound_from_warm_up_lines():
    snap = snapshot.load(BIG200_40)
    d = diagnose(snap).to_json()
    assert d["binding_constraint"] != "compute"
    assert (d["binding_constraint"], d["cause"]) == ("running_cap", "mamba_slots")
    value, source = _evidence(d)["throughput_measured_up_to"]
    assert value == 40 and _counts(source) == {40}
    reasons = " ".join(d["recommendation"]["reasons"])
    assert "flat" not in reasons


def test_a_canary_relaunch_in_the_same_log_adds_its_steady_state(tmp_path):
    # The worker appends each start to one log: the baseline at 16, then the canary at 40.
    log = tmp_path / "engine-gpu0.log"
    log.write_text((BIG80 / "engine.log").read_text() + (BIG200_40 / "engine.log").read_text())
    snap = snapshot.load(BIG200_40)
    snap["log"] = snapshot.read_log(log)
    view = view_from_snapshot(snap)
    assert {n for n, _ in view.throughput_points} == {16, 40}
    model = view.throughput
    # Two steady counts, 16 -> ~440 and 40 -> ~700 tok/s: throughput grew, no knee is claimed.
    assert model.tok_s(40) > model.tok_s(16) * 1.4
    assert model.knee() is None and not model.saturated_at(40)
    d = diagnose(snap).to_json()
    assert d["binding_constraint"] == "running_cap"
    assert _counts(_evidence(d)["throughput_measured_up_to"][1]) == {16, 40}


def test_a_fraction_raise_nothing_fits_at_backs_off_to_the_largest_that_does():
    # NVML free memory is an upper bound: say it showed 100 GiB free. The raise it allows
    # leaves the draft no room at any count; each lever takes the largest fraction that fits,
    # and never a fraction of 1 or more.
    snap = snapshot.load(BIG80)
    snap["gpu"] = {**snap["gpu"], "memory_free_mib": 100 * 1024}
    view = view_from_snapshot(snap)
    sit = situation(view)
    raised = sit.raised_fraction()["mem-fraction-static"]
    options = [o for o in running_cap_options(view.model, sit) if o.name.endswith("+mem_fraction")]
    assert options
    for option in options:
        assert option.prediction is not None, option.name
        fraction = option.changes["mem-fraction-static"]
        assert sit.fraction < fraction < raised < 1
        base = {k: v for k, v in option.changes.items()
                if k not in ("max-running-requests", "max-mamba-cache-size")}
        above = apply_changes(sit.flags, {**base, "mem-fraction-static": round(fraction + 0.01, 2)})
        # Above it, at most a sliver of counts fits (narrower than the search's stride).
        fitting = [n for n in range(1, 400) if _fits(view.model, above, n, sit) is not None]
        assert len(fitting) < SEARCH_STEP, (option.name, fitting)
