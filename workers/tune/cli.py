"""``python -m workers.tune``: snapshot, diagnose, plan, apply, auto.

Exit codes: 0 done; 2 bad input or not enough evidence (one line on stderr); 3 the fleet could
not be driven (no worker, no reply, an engine that never came back).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any

import redis

from config.launch_profile import ProfileError, load_profile
from config.settings import Settings, load_settings
from workers.tune import snapshot as snapshots
from workers.tune.memory_model import DoesNotFit
from workers.tune.render import diagnosis_text
from workers.tune.situation import InsufficientEvidence

RET_OK, RET_INPUT, RET_FLEET = 0, 2, 3


def _timing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--canary", help="gpuN or a node name (default: first healthy worker)")
    p.add_argument("--window-s", type=float, default=120.0, help="throughput window")
    p.add_argument("--settle-timeout-s", type=float, default=300.0)
    p.add_argument("--restart-timeout-s", type=float, default=1800.0)


def parser() -> argparse.ArgumentParser:
    """The command-line grammar."""
    top = argparse.ArgumentParser(prog="python -m workers.tune", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("snapshot", help="capture one GPU's engine state as JSON")
    p.add_argument("--gpu", type=int, required=True)
    p.add_argument("--out", type=Path)
    p = sub.add_parser("diagnose", help="name the binding constraint and what to change")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gpu", type=int)
    src.add_argument("--snapshot", type=Path, help="snapshot JSON, or a folder of raw captures")
    p.add_argument("--json", action="store_true")
    p.add_argument("--gpu-memory-mib", type=int, help="GPU size when NVML is not in the snapshot")
    p = sub.add_parser("plan", help="predicted cap, tok/s, ETA and cost of a job")
    p.add_argument("--profile", required=True)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--prompts", type=int, required=True)
    p.add_argument("--avg-output-tokens", type=float, required=True)
    p.add_argument("--gpu-price-per-hour", type=float)
    p.add_argument("--gpu-memory-mib", type=int, help="default: the simulator's GPU size")
    p.add_argument("--snapshot", type=Path, help="calibrate from this engine's snapshot")
    p = sub.add_parser("apply", help="canary a profile, keep it if better, roll it out")
    p.add_argument("--profile", required=True)
    _timing_args(p)
    p = sub.add_parser("auto", help="diagnose and re-tune one GPU at a time")
    p.add_argument("--max-trials", type=int, default=3)
    p.add_argument("--allow-lossy", action="store_true", help="also try bf16 SSM / FP8 KV")
    _timing_args(p)
    return top


def _redis(settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(settings.redis_url.get_secret_value(), socket_timeout=10)


def _local_beat(settings: Settings, gpu: int) -> dict[str, Any] | None:
    """This host's worker for ``gpu`` from the heartbeats (None if Redis or it is absent)."""
    from workers.heartbeat import read_heartbeats

    try:
        beats = [b for b in read_heartbeats(_redis(settings)) if b.get("gpu") == gpu]
    except redis.RedisError:
        return None
    here = [b for b in beats if b.get("host") == socket.gethostname()]
    return (here or beats or [None])[0]


def capture_local(settings: Settings, gpu: int) -> snapshots.Snapshot:
    """Snapshot GPU ``gpu``'s engine on this host."""
    target = snapshots.Target(
        gpu,
        f"http://{settings.engine_host}:{settings.engine_port(gpu)}",
        settings.log_dir / f"engine-gpu{gpu}.log",
    )
    beat = _local_beat(settings, gpu)
    profile = None
    if beat is not None:
        try:
            profile = json.loads(load_profile(beat["profile"]).model_dump_json())
        except (ProfileError, KeyError):
            profile = None
    snap = snapshots.capture(target, beat, profile)
    if settings.engine == "sim":
        snap["gpu_memory_mib"] = settings.sim.gpu_memory_mib
    return snap


def cmd_snapshot(args: argparse.Namespace, settings: Settings) -> int:
    """Capture and print or save a snapshot."""
    snap = capture_local(settings, args.gpu)
    if args.out:
        snapshots.save(snap, args.out)
        missing = ", ".join(sorted(snap.get("unavailable", {}))) or "none"
        print(f"wrote {args.out} (sections unavailable: {missing})", file=sys.stderr)
    else:
        print(json.dumps(snap, indent=1, sort_keys=True))
    return RET_OK


def cmd_diagnose(args: argparse.Namespace, settings: Settings) -> int:
    """Diagnose a snapshot file/folder or a live GPU."""
    from workers.tune.diagnose import diagnose

    snap = snapshots.load(args.snapshot) if args.snapshot else capture_local(settings, args.gpu)
    result = diagnose(snap, args.gpu_memory_mib, settings.client_headroom).to_json()
    print(json.dumps(result, indent=1) if args.json else diagnosis_text(result))
    return RET_OK


def cmd_plan(args: argparse.Namespace, settings: Settings) -> int:
    """Print the plan for a job as JSON (calibrated from a snapshot when one is given)."""
    from workers.tune.plan import JobSize, plan
    from workers.tune.situation import view_from_snapshot

    profile = load_profile(args.profile)
    job = JobSize(args.gpus, args.prompts, args.avg_output_tokens, args.gpu_price_per_hour)
    if args.snapshot is None:
        gpu_mib = args.gpu_memory_mib or settings.sim.gpu_memory_mib
        print(json.dumps(plan(profile, job, gpu_mib), indent=1))
        return RET_OK
    view = view_from_snapshot(snapshots.load(args.snapshot), args.gpu_memory_mib)
    model = view.model
    model.env = dict(profile.env)
    result = plan(profile, job, model.gpu_memory_mib, model, view.throughput)
    print(json.dumps(result, indent=1))
    return RET_OK


def _fleet(settings: Settings) -> Any:
    from workers import app
    from workers.tune.fleet import Fleet, ProfileBook

    return Fleet(settings, _redis(settings), app, ProfileBook(settings.log_dir / "tune"))


def _timing(args: argparse.Namespace) -> Any:
    from workers.tune.fleet import Timing

    return Timing(args.window_s, args.settle_timeout_s, args.restart_timeout_s)


def cmd_apply(args: argparse.Namespace, settings: Settings) -> int:
    """Canary a profile and roll it out if it is better."""
    from workers.tune.apply import apply_profile

    report = apply_profile(_fleet(settings), load_profile(args.profile), args.canary, _timing(args))
    print(json.dumps(report.to_json(), indent=1))
    return RET_OK


def cmd_auto(args: argparse.Namespace, settings: Settings) -> int:
    """Diagnose, trial and roll out, one GPU at a time."""
    from workers.tune.auto import auto

    report = auto(_fleet(settings), args.canary, _timing(args), args.max_trials, args.allow_lossy)
    print(json.dumps(report.to_json(), indent=1))
    return RET_OK


COMMANDS = {
    "snapshot": cmd_snapshot,
    "diagnose": cmd_diagnose,
    "plan": cmd_plan,
    "apply": cmd_apply,
    "auto": cmd_auto,
}


def main(argv: list[str] | None = None) -> int:
    """Run one command; errors the user can fix become one line on stderr."""
    from workers.tune.fleet import TuneError

    args = parser().parse_args(argv)
    settings = load_settings()
    try:
        return COMMANDS[args.command](args, settings)
    except (InsufficientEvidence, snapshots.SnapshotError, ProfileError, DoesNotFit) as exc:
        print(f"tune {args.command}: {exc}", file=sys.stderr)
        return RET_INPUT
    except (TuneError, redis.RedisError) as exc:
        print(f"tune {args.command}: {exc}", file=sys.stderr)
        return RET_FLEET
