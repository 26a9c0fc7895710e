"""Entry point of ``python -m workers.sim <SGLang launch flags>``: build, start, serve, stop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Iterator, Sequence
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from config.settings import SimSettings, load_settings
from workers.engine.capacity import EngineFlags, model_shape, plan_capacity, resolved_mamba_strategy
from workers.engine.versions import traits
from workers.sim.admin import admin_routes
from workers.sim.answers import ANSWERS
from workers.sim.api import native_routes
from workers.sim.calibration import calibration
from workers.sim.engine import EngineConfig, SimEngine
from workers.sim.fastpath import FastPath
from workers.sim.flags import parse_args
from workers.sim.generate import generate_handler, generate_routes
from workers.sim.openai_api import chat_handler, completions_handler, openai_routes
from workers.sim.radix import CacheMode
from workers.sim.report import Reporter, SimMetrics, log
from workers.sim.startup import run_startup
from workers.sim.state import SimState, resolved_server_args
from workers.sim.textgen import OutputLengths

# A signal ends the process within this many seconds even if a connection lingers.
EXIT_DEADLINE_S = 0.8
# Share of the start-up spent after the HTTP server listens, in the warmup: real SGLang 0.5.11
# (H200, big80 capture) listened at 07:54:12 and was "fired up" at 07:54:34, 22 s of a 102 s
# launch-to-healthy; /health answers 503 meanwhile (http_server.health_generate: ServerStatus
# Starting).
WARMUP_SHARE = 0.22


def log_prefix(args: argparse.Namespace) -> str:
    """``configure_logger`` prefix: `` DP0`` if dp > 1, `` TP0`` if tp > 1, else nothing."""
    return (" DP0" if args.dp_size > 1 else "") + (" TP0" if args.tp_size > 1 else "")


def build_state(args: argparse.Namespace, sim: SimSettings) -> SimState:
    """Plan the capacity (raises ValueError/RuntimeError like SGLang's start) and wire the sim."""
    shape = model_shape(args.model_path)
    version = traits(sim.sglang_version)
    spec_v2 = version.spec_v2_default if version else None
    # Pools and caps by the release played (its arithmetic: workers.engine.releases).
    played = sim.sglang_version if version else None
    flags = EngineFlags.from_flags(vars(args), os.environ, spec_v2, played)
    cal = calibration(sim.calibration)
    gpu_mib = sim.gpu_memory_mib if "gpu_memory_mib" in sim.model_fields_set else cal.gpu_memory_mib
    plan = plan_capacity(shape, flags, gpu_mib)
    name = args.served_model_name or args.model_path
    metrics = SimMetrics(name) if args.enable_metrics else None
    if metrics is not None:
        metrics.set(max_total_num_tokens=plan.max_total_num_tokens,
                    context_len=plan.context_len, page_size=args.page_size or 1,
                    num_pages=plan.max_total_num_tokens // (args.page_size or 1),
                    kv_available_tokens=plan.max_total_num_tokens)
    reporter = Reporter(
        metrics,
        hybrid=shape.hybrid,
        speculative=plan.num_draft_tokens > 0,
        graph_max_bs=0 if args.disable_cuda_graph else plan.cuda_graph_max_bs,
        rate_limited=sim.speed > 1,
        prefix=log_prefix(args),
        pending_token=version is None or version.prefill_pending_token,
    )
    config = EngineConfig(
        max_running_requests=plan.max_running_requests,
        max_total_num_tokens=plan.max_total_num_tokens,
        max_prefill_tokens=plan.max_prefill_tokens,
        max_mamba_cache_size=plan.max_mamba_cache_size,
        mamba_ratio=plan.mamba_ratio,
        draft_tokens=plan.num_draft_tokens,
        speed=sim.speed,
        decode_log_interval=max(1, args.decode_log_interval),
        eos_token_id=shape.eos_token_id,
        cache_mode=CacheMode(
            enabled=not flags.disable_radix_cache,
            hybrid_strategy=resolved_mamba_strategy(flags) if shape.hybrid else None,
            track_interval=args.mamba_track_interval,
        ),
        schedule_conservativeness=args.schedule_conservativeness,
        calibration=cal,
        mamba_cache_chunk=max(64, args.page_size or 1),
        overlap_schedule=plan.overlap_schedule,
    )
    return SimState(
        args=args,
        shape=shape,
        flags=flags,
        plan=plan,
        engine=SimEngine(config, reporter),
        reporter=reporter,
        metrics=metrics,
        lengths=OutputLengths(sim.mean_output_tokens, sim.output_sigma, sim.seed),
        speed=sim.speed,
        version=sim.sglang_version,
        server_args=resolved_server_args(args, flags, plan),
    )


def _die_on_failure(task: asyncio.Task[None]) -> None:
    """A crashed scheduler takes the server down with it, as in SGLang."""
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    log("Scheduler hit an exception: " + "".join(traceback.format_exception(exc)).rstrip())
    os._exit(1)


def build_app(state: SimState, warmup_s: float = 0.0) -> FastPath:
    """The Starlette app; its lifespan starts the scheduler (the load is over by then) and,
    after ``warmup_s`` of warmup during which /health answers 503, marks the server ready."""

    async def warm_up() -> None:
        await asyncio.sleep(warmup_s)
        state.ready = True
        log("The server is fired up and ready to roll!", log_prefix(state.args))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine_task = asyncio.create_task(state.engine.run(), name="sim-scheduler")
        engine_task.add_done_callback(_die_on_failure)
        warm = asyncio.create_task(warm_up(), name="sim-warmup")
        yield
        warm.cancel()
        engine_task.cancel()

    routes = (native_routes(state) + generate_routes(state) + openai_routes(state)
              + admin_routes(state))
    hot = {
        "/generate": generate_handler(state),
        "/v1/completions": completions_handler(state),
        "/v1/chat/completions": chat_handler(state),
    }
    return FastPath(Starlette(routes=routes, lifespan=lifespan), hot)


class SimServer(uvicorn.Server):
    """uvicorn server whose SIGTERM/SIGINT stop it at once (no waiting for long requests)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Install our handlers instead of uvicorn's graceful ones."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._stop)
        yield

    def _stop(self, sig: int, frame: FrameType | None) -> None:
        """Ask uvicorn to exit now; a timer guarantees the process ends within a second."""
        self.should_exit = True
        self.force_exit = True
        timer = threading.Timer(EXIT_DEADLINE_S, os._exit, args=(0,))
        timer.daemon = True
        timer.start()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the simulator with SGLang's launch flags; returns the exit status."""
    args = parse_args(argv)
    sim = load_settings().sim
    if sim.speed <= 0:
        log(f"FLEET_SIM_SPEED must be > 0, got {sim.speed}")
        return 2
    if sim.answer not in ANSWERS:
        log(f"FLEET_SIM_ANSWER must be one of {', '.join(ANSWERS)}, got {sim.answer!r}")
        return 2
    try:
        state = build_state(args, sim)
    except (ValueError, RuntimeError) as exc:
        log(f"{type(exc).__name__}: {exc}")
        return 1
    startup_s = sim.startup_s
    if "startup_s" not in sim.model_fields_set:
        startup_s = state.engine.config.calibration.startup_s
    asyncio.run(run_startup(state, startup_s * (1 - WARMUP_SHARE), log_prefix(args)))
    config = uvicorn.Config(
        build_app(state, startup_s * WARMUP_SHARE),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=0,
    )
    SimServer(config).run()
    sys.stdout.flush()
    return 0
