"""The engine lifecycle: start, wait for health, check, restart and stop one inference server.

SGLang and the CPU simulator differ only in the module they run; the same code starts, checks
and stops both. The engine runs under ``workers.engine.guard`` in its own process group, pinned
to its GPU with ``CUDA_VISIBLE_DEVICES`` (PCI bus order, as NVML numbers GPUs), on
``127.0.0.1:<base port + GPU>``. Its output goes to ``<log_dir>/engine-gpu<N>.log``.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from config.launch_profile import LaunchProfile
from workers.engine.versions import UnsupportedVersion, require_supported_engine
from workers.errors import EngineStartFailed

log = logging.getLogger(__name__)

ENGINE_MODULES = {"sglang": "sglang.launch_server", "sim": "workers.sim"}


class EngineState(str, enum.Enum):
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
    # CUDA_VISIBLE_DEVICES for the engine when it differs from the GPU index (containers).
    cuda_device: str | None = None

    @property
    def base_url(self) -> str:
        """HTTP root of the engine."""
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        """The engine's command line (what runs inside the guard)."""
        module = ENGINE_MODULES[self.kind]
        return [
            sys.executable, "-m", module,
            *self.profile.to_argv(),
            "--host", self.host, "--port", str(self.port),
        ]

    def env(self) -> dict[str, str]:
        """The engine's environment: ours, the profile's, and the GPU pin."""
        env = {**engine_base_env(os.environ), **self.profile.env}
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = self.cuda_device or str(self.gpu)
        env["FLEET_ENGINE_STOP_GRACE_S"] = str(self.stop_grace_s)
        env["PYTHONUNBUFFERED"] = "1"
        return env


class Engine:
    """One engine process and its state; safe to call from several threads."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.state = EngineState.STOPPED
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        pid = self._proc.pid if self._proc else None
        return f"<Engine gpu={self.spec.gpu} {self.state.value} pid={pid} restarts={self.restarts}>"

    @property
    def pid(self) -> int | None:
        """Pid of the guard process (leader of the engine's process group)."""
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        """Spawn the engine (no waiting); illegal unless stopped or failed."""
        with self._lock:
            if self.state not in (EngineState.STOPPED, EngineState.FAILED, EngineState.RESTARTING):
                raise EngineStartFailed(f"cannot start an engine that is {self.state.value}")
            self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            logf = self.spec.log_path.open("ab")
            guard = [sys.executable, "-m", "workers.engine.guard", str(os.getpid()), "--"]
            log.info("starting engine on GPU %d: %s", self.spec.gpu, " ".join(self.spec.argv()))
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
        try:
            resp = httpx.get(f"{self.spec.base_url}/health", timeout=timeout_s)
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
                raise EngineStartFailed(
                    f"engine on GPU {self.spec.gpu} exited with code {code} while starting; "
                    f"see {self.spec.log_path}"
                )
            if self.probe(timeout_s=5.0):
                try:  # the formats the fleet reads are known for some SGLang releases only
                    require_supported_engine(self.spec.base_url, self.spec.gpu)
                except UnsupportedVersion:
                    self.state = EngineState.FAILED
                    raise
                self.state = EngineState.HEALTHY
                log.info("engine on GPU %d healthy at %s", self.spec.gpu, self.spec.base_url)
                return
            time.sleep(0.25)
        self.state = EngineState.FAILED
        raise EngineStartFailed(
            f"engine on GPU {self.spec.gpu} not healthy after {timeout_s:.0f} s; "
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
            self.state = EngineState.RESTARTING
            self.stop()
            if profile is not None:
                self.spec = replace(self.spec, profile=profile)
            self.restarts += 1
            self.start()
        self.wait_ready(timeout_s)
