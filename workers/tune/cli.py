"""``fleet tune`` (also ``python -m workers.tune``): snapshot, diagnose, plan, apply, auto.

Each command prints a readable table or text; ``--json`` prints one JSON object for scripts.
Exit codes: 0 done; 2 bad input or not enough evidence (one line on stderr); 3 the fleet could
not be driven (no worker, no reply, an engine that never came back).
"""

from __future__ import annotations

import functools
import json
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

if TYPE_CHECKING:
    from config.launch_profile import LaunchProfile
    from config.settings import Settings
    from workers.tune import snapshot as snapshots

RET_OK, RET_INPUT, RET_FLEET = 0, 2, 3

app = typer.Typer(
    help="Read an engine's state, name what limits it, plan a job, and re-tune the fleet.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
F = TypeVar("F", bound=Callable[..., Any])

JSON_OPT = typer.Option(False, "--json", help="Print one JSON object")
CANARY_OPT = typer.Option(None, "--canary", help="gpuN or a node name (default: the first "
                          "healthy worker)")
WINDOW_OPT = typer.Option(120.0, "--window-s", help="Seconds of throughput per measurement")
SETTLE_OPT = typer.Option(300.0, "--settle-timeout-s", help="Seconds to wait for a full engine")
RESTART_OPT = typer.Option(1800.0, "--restart-timeout-s", help="Seconds to wait for a restart")


def tune_errors(fn: F) -> F:
    """Errors the user can fix become one line on stderr and a named exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import redis

        from config.launch_profile import ProfileError
        from workers.tune import snapshot as snapshots
        from workers.tune.fleet import TuneError
        from workers.tune.memory_model import DoesNotFit
        from workers.tune.situation import InsufficientEvidence

        try:
            return fn(*args, **kwargs)
        except (InsufficientEvidence, snapshots.SnapshotError, ProfileError, DoesNotFit) as exc:
            print(f"tune {fn.__name__}: {exc}", file=sys.stderr)
            raise typer.Exit(RET_INPUT) from None
        except (TuneError, redis.RedisError) as exc:
            print(f"tune {fn.__name__}: {exc}", file=sys.stderr)
            raise typer.Exit(RET_FLEET) from None

    return wrapper  # type: ignore[return-value]


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=1) + "\n")


def _print_table(table: Any) -> None:
    from rich.console import Console

    Console(highlight=False).print(table)


def _redis(settings: Settings) -> Any:
    import redis

    return redis.Redis.from_url(settings.redis_url.get_secret_value(), socket_timeout=10)


def _local_beat(settings: Settings, gpu: int) -> dict[str, Any] | None:
    """This host's worker for ``gpu`` from the heartbeats (None if Redis or it is absent)."""
    import redis

    from workers.node.heartbeat import read_heartbeats

    try:
        beats = [b for b in read_heartbeats(_redis(settings))
                 if gpu in (b.get("gpus") or [b.get("gpu")])]  # a GPU group holds it too
    except redis.RedisError:
        return None
    here = [b for b in beats if b.get("host") == socket.gethostname()]
    return (here or beats or [None])[0]


def capture_local(settings: Settings, gpu: int) -> snapshots.Snapshot:
    """Snapshot GPU ``gpu``'s engine on this host."""
    from config.launch_profile import ProfileError, load_profile
    from workers.engine.lifecycle import ParallelismMismatch, group_profile
    from workers.node.gpu_group import GpuGroup
    from workers.tune import snapshot as snapshots
    from workers.tune.job_lengths import running_job_section

    beat = _local_beat(settings, gpu)
    # The worker's GPU group: its first GPU's port, the group's log, every GPU's NVML.
    group = GpuGroup(tuple((beat or {}).get("gpus") or [(beat or {}).get("gpu", gpu)]))
    port = (beat or {}).get("port") or settings.engine_port(group.first)
    target = snapshots.Target(
        group.first,
        f"http://{settings.engine_host}:{port}",
        settings.log_dir / f"engine-{group.name}.log",
        gpus=group.gpus,
    )
    profile = None
    if beat is not None:
        try:  # as launched on the group (--tp-size), for per-GPU memory arithmetic
            launched = group_profile(load_profile(beat["profile"]), group.size)
            profile = json.loads(launched.model_dump_json())
        except (ProfileError, KeyError, ParallelismMismatch):
            profile = None
    job = running_job_section(settings, _redis(settings), (beat or {}).get("node"))
    snap = snapshots.capture(target, beat, profile, job)
    if all(s in snap["unavailable"] for s in ("server_info", "loads", "metrics")):
        raise snapshots.SnapshotError(
            f"no engine answers on GPU {gpu} at {target.base_url}: is its worker running? "
            f"(celery -A workers worker -Q gpu{gpu} -n gpu{gpu}@%h)")
    if settings.engine == "sim":
        snap["gpu_memory_mib"] = settings.sim.gpu_memory_mib
    return snap


def _settings() -> Settings:
    from config.settings import load_settings

    return load_settings()


@app.command()
@tune_errors
def snapshot(
    gpu: int = typer.Option(..., "--gpu", help="GPU index on this host"),
    out: Path = typer.Option(None, "--out", help="Write the snapshot JSON to this file"),
    as_json: bool = JSON_OPT,
) -> None:
    """Capture one GPU's engine state (metrics, loads, server info, log, NVML)."""
    from workers.tune import snapshot as snapshots
    from workers.tune.tables import object_table

    snap = capture_local(_settings(), gpu)
    missing = ", ".join(sorted(snap.get("unavailable", {}))) or "none"
    if out:
        snapshots.save(snap, out)
        print(f"wrote {out} (sections unavailable: {missing})", file=sys.stderr)
    elif as_json:
        _print_json(snap)
    else:
        sections = {k: "captured" for k in sorted(snap) if k != "unavailable"}
        sections.update({k: f"unavailable: {v}" for k, v in snap.get("unavailable", {}).items()})
        _print_table(object_table(f"snapshot of GPU {gpu} (--json for the data)", sections))


@app.command()
@tune_errors
def diagnose(
    gpu: int = typer.Option(None, "--gpu", help="A live GPU on this host"),
    snapshot: Path = typer.Option(None, "--snapshot",
                                  help="Snapshot JSON, or a folder of raw captures"),
    as_json: bool = JSON_OPT,
    gpu_memory_mib: int = typer.Option(None, "--gpu-memory-mib",
                                       help="GPU size when NVML is not in the snapshot"),
) -> None:
    """Name the binding constraint and what to change."""
    from workers.tune import snapshot as snapshots
    from workers.tune.diagnose import diagnose as run_diagnose
    from workers.tune.render import diagnosis_text

    if (gpu is None) == (snapshot is None):
        raise typer.BadParameter("give exactly one of --gpu and --snapshot")
    settings = _settings()
    snap = snapshots.load(snapshot) if snapshot else capture_local(settings, gpu)
    result = run_diagnose(snap, gpu_memory_mib, settings.client_headroom).to_json()
    if as_json:
        _print_json(result)
    else:
        print(diagnosis_text(result))


def _tuned_plan(profile: LaunchProfile, job: Any, gpu_mib: int, model: Any, calibrated: bool,
                throughput: Any, allow_lossy: bool) -> dict[str, Any] | None:
    """The plan of what the tuner would launch instead, with the flags it changes (a model
    calibrated from a snapshot predicts any flags; the catalogue's is built per profile)."""
    from workers.tune.alternative import tuner_profile
    from workers.tune.flags import flag_changes
    from workers.tune.memory_model import catalog_model
    from workers.tune.plan import plan

    context_len = model.predict(profile.flags).plan.context_len
    tuned = tuner_profile(profile, model, allow_lossy, throughput, job.kv_need(context_len))
    if tuned is None:
        return None
    tuned_model = model if calibrated else catalog_model(tuned.flags, gpu_mib, tuned.env)
    out = plan(tuned, job, gpu_mib, tuned_model, throughput)
    out["flag_changes"] = flag_changes(profile.flags, tuned.flags)
    return out


@app.command()
@tune_errors
def plan(
    profile: str = typer.Option(..., "--profile", help="Launch profile name or TOML path"),
    gpus: int = typer.Option(..., "--gpus", min=1, help="GPUs the job runs on"),
    prompts: int = typer.Option(..., "--prompts", min=1, help="Prompts in the job"),
    avg_output_tokens: float = typer.Option(..., "--avg-output-tokens", min=1.0,
                                            help="Mean generated tokens per prompt"),
    avg_prompt_tokens: float = typer.Option(0.0, "--avg-prompt-tokens", min=0.0,
                                            help="Mean prompt tokens (sizes the KV need)"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", min=1,
                                       help="The job's max_new_tokens (default: the context)"),
    gpu_price_per_hour: float = typer.Option(None, "--gpu-price-per-hour",
                                             help="Price of one GPU hour, for the cost"),
    gpu_memory_mib: int = typer.Option(None, "--gpu-memory-mib",
                                       help="GPU size (default: the simulator's)"),
    snapshot: Path = typer.Option(None, "--snapshot",
                                  help="Calibrate from this engine's snapshot"),
    allow_lossy: bool = typer.Option(False, "--allow-lossy",
                                     help="Let the tuner's column use bf16 SSM state too"),
    as_json: bool = JSON_OPT,
) -> None:
    """Predicted cap, tok/s, ETA and cost of a job, beside what the tuner would launch."""
    from config.launch_profile import load_profile
    from workers.tune import snapshot as snapshots
    from workers.tune.memory_model import catalog_model
    from workers.tune.plan import JobSize
    from workers.tune.plan import plan as make_plan
    from workers.tune.situation import view_from_snapshot
    from workers.tune.tables import plan_table
    from workers.tune.throughput import WORKLOAD

    given = load_profile(profile)
    job = JobSize(gpus, prompts, avg_output_tokens, gpu_price_per_hour, avg_prompt_tokens,
                  max_new_tokens)
    if snapshot is None:
        gpu_mib = gpu_memory_mib or _settings().sim.gpu_memory_mib
        model, throughput = catalog_model(given.flags, gpu_mib, given.env), WORKLOAD
    else:
        view = view_from_snapshot(snapshots.load(snapshot), gpu_memory_mib)
        model, throughput = view.model, view.throughput
        model.env = dict(given.env)
        gpu_mib = model.gpu_memory_mib
    result = make_plan(given, job, gpu_mib, model, throughput)
    tuned = _tuned_plan(given, job, gpu_mib, model, snapshot is not None, throughput,
                        allow_lossy)
    if as_json:
        _print_json({**result, "tuner_alternative": tuned})
    else:
        _print_table(plan_table(result, tuned))


def _fleet(settings: Settings) -> Any:
    from workers import app as celery_app
    from workers.tune.fleet import Fleet, ProfileBook

    return Fleet(settings, _redis(settings), celery_app, ProfileBook(settings.log_dir / "tune"))


def _timing(window_s: float, settle_s: float, restart_s: float) -> Any:
    from workers.tune.fleet import Timing

    return Timing(window_s, settle_s, restart_s)


@app.command()
@tune_errors
def apply(
    profile: str = typer.Option(..., "--profile", help="Launch profile name or TOML path"),
    canary: str = CANARY_OPT,
    window_s: float = WINDOW_OPT,
    settle_timeout_s: float = SETTLE_OPT,
    restart_timeout_s: float = RESTART_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Canary a profile on one GPU, keep it if faster, roll it out to the rest."""
    from config.launch_profile import load_profile
    from workers.tune.apply import apply_profile
    from workers.tune.tables import object_table

    settings = _settings()
    report = apply_profile(_fleet(settings), load_profile(profile), canary,
                           _timing(window_s, settle_timeout_s, restart_timeout_s)).to_json()
    if as_json:
        _print_json(report)
    else:
        _print_table(object_table("tune apply", report))


@app.command()
@tune_errors
def auto(
    max_trials: int = typer.Option(3, "--max-trials", min=1, help="Profiles tried at most"),
    allow_lossy: bool = typer.Option(False, "--allow-lossy", help="Also try bf16 SSM / FP8 KV"),
    canary: str = CANARY_OPT,
    window_s: float = WINDOW_OPT,
    settle_timeout_s: float = SETTLE_OPT,
    restart_timeout_s: float = RESTART_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Diagnose, trial and roll out, one GPU at a time."""
    from workers.tune.auto import auto as run_auto
    from workers.tune.tables import object_table

    settings = _settings()
    report = run_auto(_fleet(settings), canary,
                      _timing(window_s, settle_timeout_s, restart_timeout_s), max_trials,
                      allow_lossy).to_json()
    if as_json:
        _print_json(report)
    else:
        _print_table(object_table("tune auto", report))


def main(argv: list[str] | None = None) -> int:
    """Run one command (``python -m workers.tune``); returns the exit code."""
    try:
        app(args=argv, prog_name="python -m workers.tune")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return RET_OK
