"""The KV floor: a launch is only as good as the running count its KV pool holds for THIS job.

On the real H200 the tuner's no-radix launch gave 108 running with 34,949 KV tokens, sized for
the test load's short rows (what requests held at the snapshot). For the workload's thinking
traces (mean 2,490 output tokens, ``max_new_tokens`` 7,000, context 8,192) that pool holds a
handful. These tests check SGLang's admission arithmetic against a hand replay of
``PrefillAdder``, that ``diagnose`` on the real baseline never recommends a cap its KV pool
cannot hold for the job, that ``tune plan`` applies the same floor, and that the job's lengths
are read from the fleet's own records.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import redis

from config.launch_profile import load_profile
from workers.dataset.jobs import JobSpec, SamplingSpec, encode_rows, input_key, result_key
from workers.dataset.store import LocalStore
from workers.delivery import jobstate
from workers.redisdb.keys import NodeKeys
from workers.tune import kv_floor, snapshot
from workers.tune.diagnose import diagnose
from workers.tune.flags import apply_changes
from workers.tune.job_lengths import job_section
from workers.tune.plan import JobSize, plan
from workers.tune.situation import view_from_snapshot

SNAPSHOTS = Path(__file__).parent / "fixtures" / "tune" / "snapshots"
BIG80 = SNAPSHOTS / "real_h200_big80"
CONTEXT = 8192
# docs/workload.md: mean 2,490 output tokens, jobs run with --max-new-tokens 7000; the
# simulator draws log-normal lengths with sigma 0.8.
WORKLOAD_JOB = {"name": "workload", "max_new_tokens": 7000, "output_tokens_mean": 2490,
                "completed": 4000, "output_source": "job counters (completed rows)"}
# The GPU check's rows (bench/results/gpu-check-20261201-095500): max_tokens mean 150, cap 400.
SHORT_JOB = {"name": "gpu-check", "max_new_tokens": 400, "output_tokens_mean": 150,
             "completed": 500, "output_source": "job counters (completed rows)"}
# What the relaunched engine logged (bench/results/gpu-check-20261201-095500-engine-gpu0.log).
REAL_RELAUNCH_KV = 34_949


def _prefill_adder_replay(pool: int, prompt: float, held: float, max_new: int,
                          reserved: float, ratio: float) -> int:
    """Admit requests one at a time as ``PrefillAdder.add_one_req`` does (``total_tokens >=
    rem_total_tokens`` refuses), each running request holding ``held`` and charged
    ``reserved * ratio`` (``_get_running_request_total_token_offset``)."""
    running = 0
    while True:
        rem_total = pool - running * held - running * reserved * ratio
        total_tokens = prompt + min(max_new, 4096) + 1  # + page_size
        if total_tokens >= rem_total:
            return running
        running += 1


def test_kv_held_requests_is_sglangs_admission_by_hand():
    # The relaunched real engine's pool and the workload's job. By hand: the ratio decays to
    # 0.7 x 0.14 = 0.098; a running request holds 426 + 2,490 (geometric spread: E[O^2] /
    # 2E[O] = E[O]) = 2,916 and is charged min(7,000 - 2,490, 4,096) = 4,096 x 0.098 = 401.4;
    # a newcomer needs 426 + 4,096 + 1 = 4,523. (34,949 - 4,523) / 3,317.4 = 9.17: ten are
    # admitted, the eleventh is refused.
    need = kv_floor.need_from_job(WORKLOAD_JOB, CONTEXT, prompt_fallback=426)
    assert need is not None
    assert kv_floor.floor_ratio() == pytest.approx(0.098)
    assert need.held == pytest.approx(2916)
    assert need.reserved == pytest.approx(4096)
    assert need.newcomer() == pytest.approx(4523)
    assert kv_floor.kv_held_requests(REAL_RELAUNCH_KV, need) == 10
    for pool in (4_000, 4_524, 7_840, 7_841, 34_949, 221_232, 880_589):
        for ratio in (0.098, 0.3, 0.7):
            expected = _prefill_adder_replay(pool, need.prompt, need.held, need.max_new,
                                             need.reserved, ratio)
            assert kv_floor.kv_held_requests(pool, need, ratio) == expected, (pool, ratio)
    # The short test load: 426 + 150 held, min(400 - 150, 4096) = 250 reserved.
    short = kv_floor.need_from_job(SHORT_JOB, CONTEXT, prompt_fallback=426)
    assert short is not None and short.held == pytest.approx(576)
    assert kv_floor.kv_held_requests(REAL_RELAUNCH_KV, short) == _prefill_adder_replay(
        REAL_RELAUNCH_KV, 426, 576, 400, 250, 0.098) >= 56


def test_the_held_tokens_are_length_biased_and_bounded():
    # Little's law over the pool's tokens: a running request holds prompt + E[O^2] / 2E[O].
    job = {**WORKLOAD_JOB, "prompt_tokens_mean": 100, "output_tokens_sq_mean": 2490 ** 2 * 1.5}
    need = kv_floor.need_from_job(job, CONTEXT)
    assert need is not None and need.held == pytest.approx(100 + 2490 * 1.5 / 2)
    assert "spread measured" in need.source
    # All outputs of one length: exactly prompt + half (steady_kv_per_request) ...
    same = kv_floor.need_from_job({**job, "output_tokens_sq_mean": 2490 ** 2}, CONTEXT)
    assert same is not None and same.held == pytest.approx(100 + 1245)
    # ... and never past max_new / 2 whatever the spread claims.
    wide = kv_floor.need_from_job({**job, "output_tokens_sq_mean": 1e12}, CONTEXT)
    assert wide is not None and wide.held == pytest.approx(100 + 3500)
    # No job: every request to the context (prompt + half of the rest, budgeted the rest).
    ctx = kv_floor.need_from_context(CONTEXT)
    assert (ctx.held, ctx.max_new, ctx.basis) == (4096, 8192, kv_floor.BASIS_CONTEXT)


def _lognormal_job(mean: float, sigma: float, cap: int, n: int = 20_000) -> dict:
    rng = random.Random(7)
    mu = math.log(mean) - sigma * sigma / 2
    outs = [min(cap, max(1, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]
    return {"name": "lognormal", "max_new_tokens": cap, "rows": n,
            "output_tokens_mean": sum(outs) / n,
            "output_tokens_sq_mean": sum(o * o for o in outs) / n,
            "output_source": "stored results"}


def _recommended(snap: dict) -> tuple[dict, dict]:
    d = diagnose(snap).to_json()
    rec = d["recommendation"]
    return d, next(o for o in rec["options"] if o["name"] == rec["chosen"])


@pytest.mark.parametrize("job", [WORKLOAD_JOB, _lognormal_job(2490, 0.8, 7000)],
                         ids=["counters", "lognormal-rows"])
def test_real_baseline_never_recommends_a_cap_its_kv_cannot_hold_for_the_job(job):
    snap = snapshot.load(BIG80)
    snap["job"] = job
    d, chosen = _recommended(snap)
    assert (d["binding_constraint"], d["cause"]) == ("running_cap", "mamba_slots")
    n = d["recommendation"]["predicted"]["max_running_requests"]
    need = next(e for e in d["evidence"] if e["name"] == "kv_need_per_request")
    assert need["source"].startswith("job: job ")
    # Recomputed outside the tuner: the recommended pool admits its cap of this job.
    view = view_from_snapshot(snap)
    prompt = view.readings.metrics.total("prompt_tokens_total") / view.readings.metrics.total(
        "num_requests_total")
    expected = kv_floor.need_from_job(job, CONTEXT, prompt)
    assert expected is not None and need["value"] == round(expected.held)
    kv = d["recommendation"]["predicted"]["kv_tokens"]
    assert kv_floor.kv_held_requests(kv, expected) >= n
    assert chosen["kv_holds_requests"] >= n == chosen["effective_running"]
    # Every option is ranked by what its KV pool holds, never by a cap it cannot fill.
    for option in d["recommendation"]["options"]:
        if option["predicted"]:
            assert option["effective_running"] <= option["kv_holds_requests"]
    # The tuner still beats the expert's 40 on this GPU, lossless.
    assert n >= 40 and "mamba-ssm-dtype" not in d["recommendation"]["flags"]
    reasons = " ".join(d["recommendation"]["reasons"])
    assert "this job's" in reasons and "KV, not the slots, sets the cap" in reasons


def test_short_rows_may_keep_the_real_no_radix_launch_of_108():
    snap = snapshot.load(BIG80)
    snap["job"] = SHORT_JOB
    d, chosen = _recommended(snap)
    assert chosen["name"].startswith("no_radix")
    short_n = d["recommendation"]["predicted"]["max_running_requests"]
    assert short_n >= 100 and chosen["kv_holds_requests"] >= short_n
    snap["job"] = WORKLOAD_JOB
    long_n = diagnose(snap).to_json()["recommendation"]["predicted"]["max_running_requests"]
    assert long_n < short_n


def _relaunched_profile():
    # The launch tune auto made on the real engine: no radix, 0.93, 108 slots and running.
    base = load_profile("qwen36-27b-baseline-h200-dummy")
    flags = apply_changes(base.flags, {"disable-radix-cache": True, "mamba-scheduler-strategy":
                                       None, "mem-fraction-static": 0.93,
                                       "max-mamba-cache-size": 108, "max-running-requests": 108})
    return base.model_copy(update={"name": "relaunched", "flags": flags})


def test_plan_applies_the_kv_floor_to_the_real_relaunch():
    view = view_from_snapshot(snapshot.load(BIG80))
    profile = _relaunched_profile()
    long = plan(profile, JobSize(1, 10_000, 2490, avg_prompt_tokens=426, max_new_tokens=7000),
                view.model.gpu_memory_mib, view.model, view.throughput)
    kv = long["predicted"]["kv_tokens"]
    assert long["predicted"]["max_running_requests"] == 108
    assert kv == pytest.approx(REAL_RELAUNCH_KV, rel=0.02)  # the real engine's 34,949
    need = kv_floor.need_from_lengths(426, 2490, 7000, CONTEXT)
    assert long["kv_holds_requests"] == kv_floor.kv_held_requests(kv, need) < 20
    assert long["running_per_gpu"] == long["kv_holds_requests"]
    assert long["running_bound"] == "kv"
    assert long["tok_s_per_gpu"] == round(view.throughput.tok_s(long["running_per_gpu"]))
    # The GPU check's own rows: short prompts (the engine logged #full token 6,400 at 100
    # running just after admission, ~64 each) and 150 output tokens: the cap of 108 binds, as
    # the real engine ran 94-100 there without a retraction.
    short = plan(profile, JobSize(1, 10_000, 150, avg_prompt_tokens=64, max_new_tokens=400),
                 view.model.gpu_memory_mib, view.model, view.throughput)
    assert (short["running_per_gpu"], short["running_bound"]) == (108, "cap")
    # The same rows with the capture's 426-token prompts would not fill it.
    wide = plan(profile, JobSize(1, 10_000, 150, avg_prompt_tokens=426, max_new_tokens=400),
                view.model.gpu_memory_mib, view.model, view.throughput)
    assert wide["running_bound"] == "kv" and wide["running_per_gpu"] < 108


def test_the_running_jobs_lengths_come_from_the_fleets_records(r: redis.Redis, tmp_path):
    store = LocalStore(tmp_path / "store")
    spec = JobSpec(name="traces", total=6, batch_size=3, n_batches=2, input_path="x",
                   input_fingerprint="f", sampling=SamplingSpec(max_new_tokens=7000))
    jobstate.register_job(r, "traces", spec.model_dump_json())
    r.hset(NodeKeys("gpu0@host").in_flight, "traces/1", b"{}")
    # Nothing finished yet: max_new_tokens only, every row to it.
    section = job_section(r, "gpu0@host", store)
    assert section == {"name": "traces", "max_new_tokens": 7000, "batch_size": 3}
    need = kv_floor.need_from_job(section, CONTEXT)
    assert need is not None and need.held == pytest.approx(3500)
    # Batch 0 is stored: its rows give the prompt, the mean and the spread.
    rows = [{"status": "ok", "prompt_tokens": 100, "completion_tokens": c}
            for c in (1000, 2000, 6000)]
    store.put(result_key("traces", 0), encode_rows(rows, compress=False))
    jobstate.set_batch_counts(r, "traces", 0, {"completed": 3, "output_tokens": 9000})
    section = job_section(r, "gpu0@host", store)
    assert section is not None
    assert section["output_tokens_mean"] == 3000 and section["prompt_tokens_mean"] == 100
    assert section["output_tokens_sq_mean"] == pytest.approx((1e6 + 4e6 + 36e6) / 3)
    need = kv_floor.need_from_job(section, CONTEXT)
    assert need is not None and need.held == pytest.approx(100 + 41e6 / 3 / 6000)
    # Rows that carry their own max_tokens (OpenAI batch) and a spec without a job-wide one.
    spec2 = spec.model_copy(update={"name": "batchapi", "sampling": SamplingSpec()})
    jobstate.register_job(r, "batchapi", spec2.model_dump_json())
    store.put(input_key("batchapi", 0), encode_rows(
        [{"index": i, "id": str(i), "prompt": "p", "params": {"max_tokens": m}}
         for i, m in enumerate((120, 400, 90))], compress=True))
    r.hset(NodeKeys("gpu1@host").in_flight, "batchapi/0", b"{}")
    assert job_section(r, "gpu1@host", store)["max_new_tokens"] == 400


def test_a_running_engine_whose_pool_is_short_for_the_job_is_told_so():
    # The engine tune auto launched on the real H200 (108 running allowed, ~34,700 KV tokens),
    # now running the workload's job: KV, not the cap, binds it, and a lever is measured
    # against the 10 it holds, not the 108 it allows.
    from dataclasses import replace

    from workers.tune.recommend import _kv_now_reason, current_running
    from workers.tune.situation import situation

    snap = snapshot.load(BIG80)
    snap["job"] = WORKLOAD_JOB
    view = view_from_snapshot(snap)
    view.current = view.model.predict(_relaunched_profile().flags)
    sit = replace(situation(view), current_cap=108)
    assert current_running(view, sit) == sit.kv_running(view.current) == 10
    reason = _kv_now_reason(view, sit)
    assert reason is not None
    assert reason.startswith("now: 108 running allowed but 34,") and "hold only 10" in reason
    assert "this job's ~2,916 tokens" in reason and "KV, not the cap" in reason
    # Short rows: the pool holds more than a cap of 90 (what requests held at this snapshot,
    # 346 each, is the floor under the rows' 64 + 150), so nothing is said.
    snap["job"] = {**SHORT_JOB, "prompt_tokens_mean": 64}
    short = view_from_snapshot(snap)
    short.current = view.current
    short_sit = replace(situation(short), current_cap=90)
    assert short_sit.kv_need.held == pytest.approx(346, abs=1)
    assert short_sit.kv_running(view.current) > 90
    assert _kv_now_reason(short, short_sit) is None


def test_a_folder_of_raw_captures_carries_the_job_as_job_json(tmp_path):
    import json
    import shutil

    folder = tmp_path / "big80"
    shutil.copytree(BIG80, folder)
    (folder / "job.json").write_text(json.dumps(WORKLOAD_JOB))
    snap = snapshot.load(folder)
    assert snap["job"] == WORKLOAD_JOB
    d = diagnose(snap).to_json()
    need = next(e for e in d["evidence"] if e["name"] == "kv_need_per_request")
    assert need["source"].startswith("job: job workload")


@pytest.mark.parametrize(("batch_size", "told"), [(50, True), (500, False)])
def test_a_launch_the_workers_batches_cannot_fill_is_named(batch_size: int, told: bool):
    """The GPU check's batches of 50 (two per worker: 100 prompts) under the 108 the real
    relaunch ran: the reasons say the engine will not fill and what batch size would."""
    snap = snapshot.load(BIG80)
    snap["job"] = {**SHORT_JOB, "batch_size": batch_size, "worker_prompts_max": 2 * batch_size}
    d, _chosen = _recommended(snap)
    cap = d["recommendation"]["predicted"]["max_running_requests"]
    assert cap > 100  # the short rows keep the no-radix launch
    said = [x for x in d["recommendation"]["reasons"] if "will not fill" in x]
    assert bool(said) is told, d["recommendation"]["reasons"]
    if told:
        assert "at most 100 prompts" in said[0]
        assert f"batches of at least {-(-cap // 2)}" in said[0]


def test_the_snapshot_says_how_many_prompts_a_worker_can_hold(r: redis.Redis, tmp_path):
    from config.settings import load_settings
    from workers.tune.job_lengths import running_job_section

    spec = JobSpec(name="held", total=100, batch_size=50, n_batches=2, input_path="x",
                   input_fingerprint="f", sampling=SamplingSpec(max_new_tokens=400))
    jobstate.register_job(r, "held", spec.model_dump_json())
    r.hset(NodeKeys("gpu0@host").in_flight, "held/0", b"{}")
    settings = load_settings().model_copy(update={"store_url": (tmp_path / "s").as_uri()})
    section = running_job_section(settings, r, "gpu0@host")
    assert section is not None
    assert section["worker_prompts_max"] == settings.batches_per_gpu * 50
