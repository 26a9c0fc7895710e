"""The engine lifecycle: start, wait for health, check, restart and stop one inference server.

SGLang and the CPU simulator differ only in the module they run; the same code starts, checks
and stops both. The engine runs under ``workers.engine.guard`` in its own process group, pinned
to its GPUs with ``CUDA_VISIBLE_DEVICES`` (PCI bus order, as NVML numbers GPUs), on
``127.0.0.1:<base port + first GPU>``. Its output goes to ``<log_dir>/engine-gpu<N>.log``
(``engine-gpu0-1.log`` for a group).

An engine on a group of N GPUs is one tensor-parallel server: it is launched with
``--tp-size N`` unless its profile sets ``tp-size`` or ``dp-size`` itself, and then
``tp-size x dp-size`` must be N (SGLang places ``tp_size * dp_size`` ranks on consecutive
visible GPUs, ``base_gpu_id + rank * gpu_id_step``: ``ServerArgs`` and
``DataParallelController.launch_tensor_parallel_group``). With ``--enable-dp-attention`` the
DP ranks share the TP ranks' GPUs, so ``tp-size`` alone must be N.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from config.launch_profile import FlagValue, LaunchProfile
from workers.engine.releases import engine_flags
from workers.engine.versions import UnsupportedVersion, installed_version, require_supported_engine
from workers.errors import EngineStartFailed

log = logging.getLogger(__name__)

ENGINE_MODULES = {"sglang": "sglang.launch_server", "sim": "workers.sim"}


class EngineState(enum.StrEnum):
    """Where an engine is in its life."""

    STOPPED = "stopped"
    STARTING = "starting"
    HEALTHY = "healthy"
    RESTARTING = "restarting"
    FAILED = "failed"


# What the engine may inherit from the worker: the system, Python, CUDA/NCCL, the model cache,
# SGLang's and its kernels' own settings, and the simulator's. Never the worker's secrets
# (AWS keys, the Redis URL and password, HF_TOKEN: the engine runs offline).
ENGINE_ENV_NAMES = frozenset({"PATH", "HOME", "USER", "LANG", "TZ", "TMPDIR", "TERM",
                              "LD_LIBRARY_PATH", "VIRTUAL_ENV",
                              "XDG_CACHE_HOME"})
ENGINE_ENV_PREFIXES = ("LC_", "PYTHON", "CUDA_", "NVIDIA_", "NCCL_", "HF_", "HUGGINGFACE_",
                       "TRANSFORMERS_", "SGLANG_", "FLASHINFER_", "TRITON_", "TORCH", "OMP_",
                       "MKL_", "TOKENIZERS_", "FLEET_SIM_")
# A name with one of these words (between underscores) is a secret: HF_TOKEN, *_SECRET_*,
# *_KEY. Whole words only: FLEET_SIM_MEAN_OUTPUT_TOKENS is a setting, not a token.
SECRET_WORDS = frozenset({"TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL",
                          "CREDENTIALS", "AUTH"})


def engine_base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of the worker's environment the engine gets (see ENGINE_ENV_PREFIXES)."""
    return {k: v for k, v in environ.items()
            if (k in ENGINE_ENV_NAMES or k.startswith(ENGINE_ENV_PREFIXES))
            and SECRET_WORDS.isdisjoint(k.split("_"))}


# SGLang's own advice when a start fails, as its log prints it (0.5.11):
# compilation/piecewise_context_manager.py::PIECEWISE_CUDA_GRAPH_CAPTURE_FAILED_MSG ("To work
# around this error, add --disable-piecewise-cuda-graph to your launch command.") and
# model_executor/cuda_graph_runner.py::CUDA_GRAPH_CAPTURE_FAILED_MSG ("Possible solutions:" then
# numbered lines, the first "set --mem-fraction-static to a smaller value ...").
HINT_PATTERNS = (
    re.compile(r"To work around this error, (add --[\w-]+[^.\n]*?)"
               r"(?: to your launch command)?\.?$"),
    re.compile(r"^\s*1\. (set --[\w-]+ [^\n]*)$"),
)
# The last line of a Python traceback: "AssertionError: ...", "torch.OutOfMemoryError: ...".
ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit)(?::\s.*)?$")
LOG_TAIL_BYTES = 64 * 1024


def start_failure(log_path: Path) -> str:
    """SGLang's last error line and its own hint from the tail of an engine's log, as one
    clause (empty when the log has neither)."""
    try:
        with log_path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    error = hint = ""
    for line in lines:
        text = line.strip()
        if ERROR_LINE.match(text):
            error = text
        for pattern in HINT_PATTERNS:
            found = pattern.search(text)
            if found:
                hint = found.group(1).strip()
    parts = []
    if error:
        parts.append(error if len(error) <= 300 else error[:297] + "...")
    if hint:
        parts.append(f"SGLang's hint: {hint}")
    return "; ".join(parts)


def prelaunch_refusals(spec: EngineSpec) -> list[str]:
    """The rules by which SGLang would refuse this launch at start (``launch_refusals.
    known_refusals`` and ``check_hybrid_flags``), from the profile's flags and the model's
    config.json; empty for the simulator, or when the config cannot be read here (then SGLang
    itself decides)."""
    if spec.kind != "sglang":
        return []
    from workers.engine.launch_refusals import check_hybrid_flags, known_refusals
    from workers.engine.model_config import ModelConfigError, model_shape
    from workers.engine.server_args import EngineFlags

    profile = spec.launch_profile()
    model = profile.flags.get("model-path")
    if not isinstance(model, str):
        return []
    try:
        shape = model_shape(model)
    except (ModelConfigError, ValueError, KeyError, TypeError):
        return []
    flags = EngineFlags.from_flags(profile.flags, env={**os.environ, **profile.env},
                                   version=installed_version())
    found = [str(r) for r in known_refusals(shape, flags)]
    if shape.hybrid:
        try:
            check_hybrid_flags(flags)
        except ValueError as exc:
            found.append(f"{exc} (SGLang server_args.py::ServerArgs._handle_mamba_radix_cache)")
    return found


# Spellings SGLang's argparse accepts for the parallel sizes (server_args.py add_cli_args).
TP_FLAGS = ("tp-size", "tensor-parallel-size")
DP_FLAGS = ("dp-size", "data-parallel-size")


class ParallelismMismatch(EngineStartFailed):
    """A profile's tp-size / dp-size do not cover the engine's GPUs exactly."""


def _size(profile: LaunchProfile, names: tuple[str, ...], where: str = "") -> int | None:
    values: list[FlagValue] = [profile.flags[n] for n in names if n in profile.flags]
    if not values:
        return None
    value = values[0]
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit():
        raise ParallelismMismatch(f"{where or 'the engine'}: profile {profile.name} sets "
                                  f"{names[0]} {value!r}, not a positive integer")
    return int(value)


def group_profile(profile: LaunchProfile, gpus: int, where: str = "") -> LaunchProfile:
    """``profile`` as launched on ``gpus`` GPUs: with ``tp-size = gpus`` when it sets neither
    size (unchanged on one GPU); raises ParallelismMismatch (one line, naming ``where``) when
    the sizes it sets do not multiply to ``gpus``."""
    tp, dp = _size(profile, TP_FLAGS, where), _size(profile, DP_FLAGS, where)
    if tp is None and dp is None:
        return profile if gpus == 1 else profile.with_flags(profile.name, tp_size=gpus)
    tp, dp = tp or 1, dp or 1
    used = tp if profile.flags.get("enable-dp-attention") is True else tp * dp
    if used != gpus or tp < 1 or dp < 1:
        how = (f"tp-size {tp} (dp attention)" if used == tp and dp > 1 else
               f"tp-size {tp} x dp-size {dp} = {used}")
        raise ParallelismMismatch(f"{where or 'the engine'} is {gpus} GPU(s) but profile "
                                  f"{profile.name} asks for {how}")
    return profile


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to launch one engine."""

    kind: str  # "sglang" or "sim"
    profile: LaunchProfile
    gpu: int
    host: str
    port: int
    log_path: Path
    stop_grace_s: float = 30.0
    # CUDA_VISIBLE_DEVICES for the engine when it differs from the GPU indices (containers).
    cuda_device: str | None = None
    # Every GPU of the engine's group, first one = ``gpu``; () means ``(gpu,)``.
    gpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # A profile that does not fit the group is refused here, before anything starts.
        self.launch_profile()

    @property
    def group(self) -> tuple[int, ...]:
        """The GPUs this engine runs on."""
        return self.gpus or (self.gpu,)

    @property
    def where(self) -> str:
        """``GPU 3`` or ``GPUs 0,1`` for log lines and errors."""
        group = self.group
        return f"GPU {group[0]}" if len(group) == 1 else f"GPUs {','.join(map(str, group))}"

    @property
    def base_url(self) -> str:
        """HTTP root of the engine."""
        return f"http://{self.host}:{self.port}"

    def launch_profile(self) -> LaunchProfile:
        """The profile as launched on this group (``--tp-size`` added where needed)."""
        return group_profile(self.profile, len(self.group), f"the engine on {self.where}")

    @property
    def tp_size(self) -> int:
        """The engine's tensor-parallel size."""
        return _size(self.launch_profile(), TP_FLAGS) or 1

    def argv(self) -> list[str]:
        """The engine's command line (what runs inside the guard)."""
        module = ENGINE_MODULES[self.kind]
        profile = self.launch_profile()
        version = installed_version() if self.kind == "sglang" else None
        if version:  # a flag the installed release renamed goes under its new name
            profile = profile.model_copy(update={"flags": engine_flags(version, profile.flags)})
        return [
            sys.executable, "-m", module,
            *profile.to_argv(),
            "--host", self.host, "--port", str(self.port),
        ]

    def env(self) -> dict[str, str]:
        """The engine's environment: ours, the profile's, and the GPU pin (every GPU of
        the group)."""
        env = {**engine_base_env(os.environ), **self.profile.env}
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = self.cuda_device or ",".join(map(str, self.group))
        env["FLEET_ENGINE_STOP_GRACE_S"] = str(self.stop_grace_s)
        env["PYTHONUNBUFFERED"] = "1"
        return env


class Engine:
    """One engine process and its state; safe to call from several threads."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.state = EngineState.STOPPED
        self.restarts = 0
        self.probes = 0  # GET /health probes sent (each one a generation on SGLang)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()
        # One client for the engine's life: building one per probe costs ~45 ms of CPU (its
        # TLS context), twice a second on an idle node. A keep-alive connection to an engine
        # that died is discarded by the pool on the next request.
        self._http = httpx.Client()

    def __repr__(self) -> str:
        pid = self._proc.pid if self._proc else None
        gpus = ",".join(map(str, self.spec.group))
        return f"<Engine gpus={gpus} {self.state.value} pid={pid} restarts={self.restarts}>"

    @property
    def pid(self) -> int | None:
        """Pid of the guard process (leader of the engine's process group)."""
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        """Spawn the engine (no waiting); illegal unless stopped or failed."""
        with self._lock:
            if self.state not in (EngineState.STOPPED, EngineState.FAILED, EngineState.RESTARTING):
                raise EngineStartFailed(f"cannot start an engine that is {self.state.value}")
            refused = prelaunch_refusals(self.spec)
            if refused:
                self.state = EngineState.FAILED
                raise EngineStartFailed(
                    f"engine on {self.spec.where} not started: SGLang refuses this launch: "
                    + "; ".join(refused))
            self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            logf = self.spec.log_path.open("ab")
            guard = [sys.executable, "-m", "workers.engine.guard", str(os.getpid()), "--"]
            log.info("starting engine on %s: %s", self.spec.where, " ".join(self.spec.argv()))
            self._proc = subprocess.Popen(
                guard + self.spec.argv(),
                env=self.spec.env(),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            logf.close()
            if self.state != EngineState.RESTARTING:
                self.state = EngineState.STARTING

    def alive(self) -> bool:
        """Whether the engine process is still running."""
        return self._proc is not None and self._proc.poll() is None

    def probe(self, timeout_s: float = 20.0) -> bool:
        """One health probe (GET /health, which runs a 1-token generation on SGLang)."""
        self.probes += 1
        try:
            resp = self._http.get(f"{self.spec.base_url}/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def wait_ready(self, timeout_s: float) -> None:
        """Block until healthy; raise EngineStartFailed if it exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = self._proc.returncode if self._proc else None
                self.state = EngineState.FAILED
                said = start_failure(self.spec.log_path)
                raise EngineStartFailed(
                    f"engine on {self.spec.where} exited with code {code} while starting"
                    f"{': ' + said if said else ''}; see {self.spec.log_path}"
                )
            if self.probe(timeout_s=5.0):
                try:  # the formats the fleet reads are known for some SGLang releases only
                    require_supported_engine(self.spec.base_url, self.spec.gpu)
                except UnsupportedVersion:
                    self.state = EngineState.FAILED
                    raise
                self.state = EngineState.HEALTHY
                log.info("engine on %s healthy at %s", self.spec.where, self.spec.base_url)
                return
            time.sleep(0.25)
        self.state = EngineState.FAILED
        raise EngineStartFailed(
            f"engine on {self.spec.where} not healthy after {timeout_s:.0f} s; "
            f"see {self.spec.log_path}"
        )

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, grace period, SIGKILL. Idempotent."""
        with self._lock:
            proc, self._proc = self._proc, None
            if self.state != EngineState.RESTARTING:
                self.state = EngineState.STOPPED
            if proc is None or proc.poll() is not None:
                return
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=self.spec.stop_grace_s + 5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass

    def restart(self, timeout_s: float, profile: LaunchProfile | None = None) -> None:
        """Stop, optionally switch profile, start again and wait for health."""
        with self._lock:
            # A profile that does not fit the group raises here, before the engine stops.
            spec = self.spec if profile is None else replace(self.spec, profile=profile)
            self.state = EngineState.RESTARTING
            self.stop()
            self.spec = spec
            self.restarts += 1
            self.start()
        self.wait_ready(timeout_s)
