"""``make gpu-check``: the whole fleet on real engines, one summary of what it did.

Starts ``redis-server``, one ``celery -A workers worker -Q gpuN`` per visible GPU with
``FLEET_ENGINE=sglang`` and the given launch profile (each worker starts and owns its SGLang
server), enqueues N prompts whose per-row ``max_tokens`` are drawn from the workload's shape,
waits, runs ``verify``, builds the data set and prints one summary (JSON and a table): engine
start time, effective cap, tokens/s from the engines' own ``/metrics``, occupancy sampled from
``/v1/loads``, verify figures. Optional phases, in this order:

- ``--plain 48,96``: after the fleet's job, a seed-style plain client (``bench/plain_client``)
  sends the same prompts with the same per-row lengths straight to the same engines;
  the ratio fleet ÷ plain is whole-job decode tokens/s from the same ``/metrics`` counter;
- ``--plain-before``: the plain client also runs before the fleet's job (order control: an
  engine decodes faster after its first minutes), and the summary gives both ratios and their
  mean (``fleet_vs_plain``); without ``--plain`` it runs 96 in flight;
- ``--fixed-tokens N`` (default 500; 0 skips it): a second job whose rows all ask exactly N
  tokens, so the engine's running requests finish on the same step (the synchronised case),
  then the plain client on the same rows (``fixed_job``);
- ``--tune-auto``: while the job runs, ``fleet tune auto`` diagnoses GPU 0 and relaunches it
  with a better profile (its own before/after measurement is kept);
- ``--kill-engine-after-s T``: a second job, during which the engine of GPU 0 is SIGKILLed T s
  after the job's first request (the worker restarts it; ``verify`` must still be exact);
- after the workers' warm shutdown, the GPUs' used memory (nvidia-smi) shows whether the
  engines gave their memory back;
- ``--request-shapes TOKENS``: on GPU 0's engine, ``cap`` requests of TOKENS tokens per shape
  (the fleet's chat body, with /health or /v1/loads probed beside it, /generate with the
  template applied once, chat with stop strings), the engine's decode rate at its cap from its
  own log (``bench/request_shapes.py``); summary key ``request_shapes``;
- ``--anchor``: then SGLang's own ``python -m sglang.bench_offline_throughput`` runs on GPU 0
  with the same launch flags, the main job's rows' lengths and the same sampling
  (``bench/sglang_anchor.py`` says how the rows reach it); summary key ``sglang_offline``
  with ``output_tok_s`` and ``fleet_ratio`` (the fleet's job's decode tokens/s ÷ it), and
  ``occupancy_from_log``: its scheduler's running-request lines, read as the fleet's engines'
  logs are for the job's ``occupancy_from_log`` (``bench/log_occupancy.py``), so the engine's
  own churn is told apart from the fleet's.

Batches follow the runbook by default (``--batch-size 0``): 4 × the in-flight budget of the
largest engine (cap × headroom + 1; 204 at cap 40), the bound below which a batch is mostly
tail.

The main job's rows are the workload's shape (log-normal, sigma 0.8) at a mean of 500 output
tokens, long enough that prefill is the workload's share of the work. Every request uses the
model's own sampling (its ``generation_config.json``): sampled, not greedy.

Dummy weights (the borrowed H200) generate random tokens: EOS almost never comes, so output
lengths are the rows' ``max_tokens``, and an MTP draft is accepted ~1.0 token per step, so
tokens/s are MTP's cost without its gain. ``--engine sim`` runs the same check on the simulator.

    python -m bench.gpu_check --profile qwen36-27b-h200-dummy --prompts 300 --plain 96 \
        --plain-before --anchor
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench import log_occupancy
from bench.common import VERIFY_ROWS_OK, Fleet, local_fleet
from bench.engines import JobWatch, LoadSampler, decode_tokens
from bench.gpu_check_engines import capture_startup, engine_loads, kill_engine, visible_gpus
from bench.gpu_check_report import goals, order_ratios, ratio, table
from bench.gpu_check_rows import WORKLOAD_SIGMA, rows_summary, write_prompts
from bench.gpu_check_tune import diagnose, tune_auto
from bench.gpu_configs import gpu_memory_used_mib
from bench.plain_client import read_prompts, run_plain
from bench.sglang_anchor import run_anchor
from config.launch_profile import load_profile
from config.settings import load_settings
from workers.delivery import jobstate

# Seconds between two samples of the engines' /v1/loads, for the fleet's job and a plain client.
WATCH_INTERVAL_S = 0.5
# The plain client's in-flight count with --plain-before and no --plain (the seed's later 96).
DEFAULT_PLAIN = 96


class StartFailed(RuntimeError):
    """No worker's engine became healthy (the launch was refused or did not fit)."""


def run_fleet_job(fleet: Fleet, urls: list[str], caps: list[int], prompts: Path, n: int,
                  job: str, batch_size: int, max_new: int, timeout_s: float,
                  during: Any = None) -> dict[str, Any]:
    """Enqueue, watch from the engines' side until done, verify; ``during(timeline)`` runs
    once the first request is running."""
    n_batches = math.ceil(n / batch_size)
    wall_start = time.time()
    with JobWatch(urls, caps, fleet.r, job, n_batches, WATCH_INTERVAL_S) as watch:
        fleet.producer("enqueue", str(prompts), "--job", job, "--batch-size", str(batch_size),
                       "--max-new-tokens", str(max_new))
        extra: dict[str, Any] = {}
        if during is not None:
            # A job quicker than the watcher's first sample is done before it is seen running.
            while watch.timeline.t_first is None and watch.timeline.t_done is None:
                time.sleep(0.2)
            extra = during(watch.timeline) or {}
        tl = watch.wait(timeout_s)
    wall_end = time.time()
    verify = json.loads(fleet.producer("verify", "--job", job, "--json",
                                        ok_codes=VERIFY_ROWS_OK).stdout)
    # The engines' own view of the same job (their logs' running-request lines).
    from_log = [log_occupancy.fleet_job(fleet.workdir / "logs" / f"engine-gpu{g}.log",
                                        wall_start, wall_end, cap) for g, cap in enumerate(caps)]
    counters = jobstate.counters(fleet.r, job)
    return {"job": job, "prompts": n, "batches": n_batches, "batch_size": batch_size,
            "seconds": round(tl.end_to_end_s, 1),
            "occupancy_from_log": _mean_occupancy(from_log), "engine_logs": from_log,
            # None when an engine restarted in the job: its counter started again at 0.
            "decode_tok_s": round(rate, 1) if (rate := tl.whole_decode_rate()) > 0 else None,
            "occupancy": round(tl.occupancy(whole=True), 3),
            # None when every batch was taken before the first request ran (one round of
            # batches): the window is empty.
            "occupancy_until_all_taken": (round(tl.occupancy(), 3) if tl.t_first is not None
                                          and (tl.t_all_taken or tl.t_done or 0) > tl.t_first
                                          else None),
            "tail_share": round(tl.tail_share, 3), "mean_waiting": round(tl.mean_waiting(), 1),
            "output_tokens": counters.get("output_tokens"),
            # Completion tokens the job stored per second (the engine's counter restarts at 0
            # with a restarted engine, so a job with a fault is read from this one).
            "stored_tok_s": round(int(counters.get("output_tokens") or 0)
                                  / max(tl.end_to_end_s, 1e-9), 1),
            "verify": verify, **extra}


def _mean_occupancy(parts: list[dict[str, Any]]) -> float | None:
    """The GPUs' mean of their log occupancies (None where no GPU logged a decode line)."""
    got = [p["occupancy"] for p in parts if p.get("occupancy") is not None]
    return round(sum(got) / len(got), 3) if got else None


def runbook_batch_size(caps: list[int], headroom: float) -> int:
    """The runbook's batch for these engines: 4 x the in-flight budget (cap x headroom + 1)
    of the largest (docs/runbook.md, "Sizing --batch-size")."""
    return 4 * (math.ceil(max(caps) * (headroom or load_settings().client_headroom)) + 1)


def run_plain_client(urls: list[str], caps: list[int], prompts: Path, in_flight: int,
                     max_new: int) -> dict[str, Any]:
    """The seed's client: ``in_flight`` requests per server, decode tok/s from /metrics. The
    engines are sampled as during the fleet's job (the same probes at the same rate)."""
    with httpx.Client(timeout=30) as http, LoadSampler(urls, caps, WATCH_INTERVAL_S) as watch:
        before = decode_tokens(http, urls)
        result = asyncio.run(run_plain(urls, read_prompts(prompts), in_flight, max_new))
        after = decode_tokens(http, urls)
    return {"in_flight": in_flight, "seconds": round(result.seconds, 1),
            "completed": result.completed, "failed": result.failed,
            "output_tokens": result.output_tokens,
            "decode_tok_s": round((after - before) / max(result.seconds, 1e-9), 1),
            "occupancy": round(watch.occupancy(), 3)}


def ordered_jobs(fleet: Fleet, args: argparse.Namespace, stamp: str, summary: dict[str, Any],
                 result: Path, urls: list[str], caps: list[int], prompts: Path,
                 during: Any) -> None:
    """The plain client before (``--plain-before``) and after the fleet's job on the same rows,
    then the fixed-length job and the plain client after it."""
    counts = [int(x) for x in args.plain.split(",") if x.strip()]
    if args.plain_before and not counts:
        counts = [DEFAULT_PLAIN]

    def plain_runs(rows: Path, key: str, job: dict[str, Any] | None,
                   into: dict[str, Any]) -> None:
        into[key] = []
        for n in counts:
            plain = run_plain_client(urls, caps, rows, n, args.max_new_tokens)
            if job is not None:
                plain["fleet_ratio"] = ratio(job["decode_tok_s"], plain["decode_tok_s"])
            into[key].append(plain)
            result.write_text(json.dumps(summary, indent=2) + "\n")

    if args.plain_before:  # on the fresh engine, before the fleet's job
        plain_runs(prompts, "plain_before", None, summary)
    job = run_fleet_job(fleet, urls, caps, prompts, args.prompts, f"gc-{stamp}",
                        args.batch_size, args.max_new_tokens, args.job_timeout_s, during)
    summary["job"] = job
    sink = fleet.producer("sink", "--job", job["job"], "--local", "--json")
    summary["dataset"] = json.loads(sink.stdout)
    for p in summary.get("plain_before", []):
        p["fleet_ratio"] = ratio(job["decode_tok_s"], p["decode_tok_s"])
    result.write_text(json.dumps(summary, indent=2) + "\n")
    plain_runs(prompts, "plain", job, summary)
    if args.plain_before:
        summary["fleet_vs_plain"] = order_ratios(job, summary["plain_before"], summary["plain"])
    result.write_text(json.dumps(summary, indent=2) + "\n")
    if args.fixed_tokens > 0:
        nfix = args.fixed_prompts or args.prompts
        fixed = write_prompts(fleet.workdir / "fixed.jsonl", nfix, args.fixed_tokens, 0.0,
                              args.max_new_tokens, args.seed + 2)
        fjob = run_fleet_job(fleet, urls, caps, fixed, nfix, f"gcx-{stamp}", args.batch_size,
                             args.max_new_tokens, args.job_timeout_s)
        fjob["rows"] = rows_summary(fixed, 0.0)
        summary["fixed_job"] = fjob
        result.write_text(json.dumps(summary, indent=2) + "\n")
        plain_runs(fixed, "plain", fjob, fjob)
        result.write_text(json.dumps(summary, indent=2) + "\n")


def phases(fleet: Fleet, args: argparse.Namespace, gpus: int, stamp: str,
           summary: dict[str, Any], result: Path) -> None:
    """Start the workers, run the job and the optional phases; ``result`` is rewritten after
    each phase."""
    t0 = time.monotonic()
    try:
        fleet.start_workers(gpus, timeout_s=args.start_timeout_s)
    except Exception as exc:  # the engine log (kept below) says why; exit 3 tells the caller
        raise StartFailed(str(exc)[-1500:]) from exc
    started = round(time.monotonic() - t0, 1)
    urls = [fleet.engine_url(g) for g in range(gpus)]
    summary["workers"] = [{"gpu": g, "healthy_after_s": started,
                           "cap": int(lo["max_running_requests"]),
                           "max_total_num_tokens": int(lo["max_total_num_tokens"])}
                          for g, lo in enumerate(engine_loads(u) for u in urls)]
    caps = [w["cap"] for w in summary["workers"]]
    if args.batch_size <= 0:
        args.batch_size = runbook_batch_size(caps, args.headroom)
    summary["batch_size"] = args.batch_size
    summary["startup_captures"] = capture_startup(urls[0], args.out, stamp)
    result.write_text(json.dumps(summary, indent=2) + "\n")
    prompts = write_prompts(fleet.workdir / "prompts.jsonl", args.prompts, args.mean_tokens,
                            args.sigma, args.max_new_tokens, args.seed)

    def during(_tl: Any) -> dict[str, Any]:
        if not args.tune_auto:
            return {}
        time.sleep(10)  # the queue fills the engine before the baseline window
        tune = summary["tune"] = {"diagnose_before": diagnose(fleet, 0)}
        result.write_text(json.dumps(summary, indent=2) + "\n")
        tune.update(tune_auto(fleet, args.tune_window_s))
        result.write_text(json.dumps(summary, indent=2) + "\n")
        tune["diagnose_after"] = diagnose(fleet, 0)
        return {}

    summary["rows"] = rows_summary(prompts, args.sigma)
    ordered_jobs(fleet, args, stamp, summary, result, urls, caps, prompts, during)
    if args.request_shapes > 0:
        from bench.request_shapes import measure

        profile = load_profile(args.profile)
        model = str(profile.flag("tokenizer-path") or profile.flag("model-path"))
        summary["request_shapes"] = measure(urls[0], caps[0],
                                            fleet.workdir / "logs" / "engine-gpu0.log", model,
                                            args.request_shapes)
        result.write_text(json.dumps(summary, indent=2) + "\n")
    if args.samples_vs_copies:  # issue 27: N samples vs the rows written N times
        from bench.samples import compare

        got = compare(fleet, urls, args.samples_vs_copies, args.samples, args.max_new_tokens)
        summary["samples_vs_copies"] = {k: v for k, v in got.items()
                                        if not k.endswith("_job")}
        summary["samples_vs_copies"]["jobs"] = {"samples": got["samples_job"],
                                                "copies": got["copies_job"]}
        result.write_text(json.dumps(summary, indent=2) + "\n")
    if args.kill_engine_after_s > 0:
        nf = args.fault_prompts or args.prompts
        fprompts = write_prompts(fleet.workdir / "fault.jsonl", nf, args.mean_tokens,
                                 args.sigma, args.max_new_tokens, args.seed + 1)

        def kill(_tl: Any) -> dict[str, Any]:
            time.sleep(args.kill_engine_after_s)
            return {"killed_guard_pid": kill_engine(0)}

        summary["fault_job"] = run_fleet_job(fleet, urls, caps, fprompts, nf, f"gcf-{stamp}",
                                             args.batch_size, args.max_new_tokens,
                                             args.job_timeout_s, kill)


def anchor(fleet: Fleet, args: argparse.Namespace, summary: dict[str, Any],
           result: Path) -> None:
    """SGLang's bench_offline_throughput on the main job's rows, GPU 0 (the workers are
    stopped: the GPU is free); ``sglang_offline`` in the summary."""
    if args.engine != "sglang":
        summary["sglang_offline"] = {"error": "the anchor needs real SGLang (--engine sglang)"}
        return
    from workers.engine.versions import installed_version
    out = run_anchor(load_profile(args.profile), read_prompts(fleet.workdir / "prompts.jsonl"),
                     args.max_new_tokens, fleet.workdir, fleet.workdir / "logs" / "anchor.log",
                     args.anchor_timeout_s, installed_version(), args.seed)
    out["fleet_ratio"] = ratio(summary["job"].get("decode_tok_s"), out.get("output_tok_s"))
    # Its occupancy from its log, read as the fleet's engines' logs are (bench/log_occupancy.py).
    out["occupancy_from_log"] = log_occupancy.anchor_run(
        fleet.workdir / "logs" / "anchor.log", summary["workers"][0]["cap"])
    out["order"] = "after the fleet's workers stopped, on its own fresh engine"
    summary["sglang_offline"] = out
    result.write_text(json.dumps(summary, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run the check; exit 1 unless every job verified exactly, 3 if no engine started."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--profile", default="qwen36-27b-h200-dummy")
    ap.add_argument("--engine", default="sglang", choices=("sglang", "sim"))
    ap.add_argument("--gpus", type=int, default=0, help="workers (default: every visible GPU)")
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--mean-tokens", type=float, default=500.0)
    ap.add_argument("--sigma", type=float, default=WORKLOAD_SIGMA, help="0: every row the mean")
    ap.add_argument("--max-new-tokens", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=0,
                    help="rows per batch (default: the runbook's, 4 x the in-flight budget)")
    ap.add_argument("--batches-per-gpu", type=int, default=0,
                    help="FLEET_BATCHES_PER_GPU of the workers (default: the setting's)")
    ap.add_argument("--plain", default="", help="comma-separated in-flight counts")
    ap.add_argument("--plain-before", action="store_true",
                    help="the plain client before the fleet's job too (order control)")
    ap.add_argument("--fixed-tokens", type=int, default=500,
                    help="a second job of rows of exactly N tokens (0: none)")
    ap.add_argument("--fixed-prompts", type=int, default=0, help="default: --prompts")
    ap.add_argument("--anchor", action="store_true",
                    help="then SGLang's bench_offline_throughput on the same flags and rows")
    ap.add_argument("--anchor-timeout-s", type=float, default=900.0)
    ap.add_argument("--headroom", type=float, default=0.0,
                    help="the workers' FLEET_CLIENT_HEADROOM (default: the setting's)")
    ap.add_argument("--tune-auto", action="store_true")
    ap.add_argument("--tune-window-s", type=float, default=40.0)
    ap.add_argument("--kill-engine-after-s", type=float, default=0.0)
    ap.add_argument("--fault-prompts", type=int, default=0, help="default: --prompts")
    ap.add_argument("--samples-vs-copies", type=int, default=0, metavar="P",
                    help="issue 27: P prompts with --samples N vs the same rows written N "
                    "times (bench/samples.py), on these engines")
    ap.add_argument("--samples", type=int, default=8, help="N of --samples-vs-copies")
    ap.add_argument("--request-shapes", type=int, default=0, metavar="TOKENS",
                    help="after the jobs, what the chat route, /generate, stop strings and "
                         "probes cost the engine's step (bench/request_shapes.py), on GPU 0")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--job-timeout-s", type=float, default=1800.0)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    gpus = args.gpus or visible_gpus() or 1
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    env = {"FLEET_ENGINE": args.engine, "FLEET_PROFILE": args.profile,
           "FLEET_ENGINE_WAIT_S": "600", "FLEET_ENGINE_START_TIMEOUT_S": str(args.start_timeout_s)}
    if args.engine == "sim":  # the caller's simulator settings (FLEET_SIM_CALIBRATION, ...)
        env.update({k: v for k, v in os.environ.items() if k.startswith("FLEET_SIM_")})
    if args.batches_per_gpu:
        env["FLEET_BATCHES_PER_GPU"] = str(args.batches_per_gpu)
    if args.headroom:
        env["FLEET_CLIENT_HEADROOM"] = str(args.headroom)
    summary: dict[str, Any] = {"date": stamp, "profile": args.profile, "engine": args.engine,
                               "argv": sys.argv[1:] if argv is None else argv,
                               "gpus": gpus, "memory_before_mib": gpu_memory_used_mib(),
                               "note": "dummy weights on the H200: lengths are the rows' "
                               "max_tokens, MTP accepts ~1.0 token per step"}
    result = args.out / f"gpu-check-{stamp}.json"
    with local_fleet("gpu-check", **env) as fleet:
        finished = False
        try:
            phases(fleet, args, gpus, stamp, summary, result)
            finished = True
        except StartFailed as exc:
            summary["start_error"] = str(exc)
        finally:  # a run stopped by its time limit (SIGINT) keeps what it did and the logs
            fleet.stop_workers()
            time.sleep(3)
            summary["memory_after_stop_mib"] = gpu_memory_used_mib()
            if args.anchor and finished:  # not after an interrupt: the call's time is up
                try:
                    anchor(fleet, args, summary, result)
                except KeyboardInterrupt:  # the wrapper's SIGINT: keep what was measured
                    summary["sglang_offline"] = {"error": "interrupted by the time limit"}
            summary["goals"] = goals(summary)
            logs = fleet.workdir / "logs"
            for p in logs.glob("*.log"):
                (args.out / f"gpu-check-{stamp}-{p.name}").write_bytes(
                    p.read_bytes()[-4_000_000:])
            summary["ok"] = all(j["verify"]["ok"] for j in (summary.get("job"),
                                summary.get("fault_job")) if j) and "job" in summary and (
                summary.get("samples_vs_copies", {}).get("verified", 1.0) == 1.0)
            result.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    if "start_error" in summary:
        print(f"gpu-check: no engine became healthy: {summary['start_error']}", file=sys.stderr)
        return 3
    print(table(summary))
    return 0 if summary["ok"] else 1

if __name__ == "__main__":
    sys.exit(main())
