"""The engine simulator as a real subprocess on a free local port, as a worker launches it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from producer.localfleet import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Sim:
    """A running simulator process."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        """Everything the process printed so far."""
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Poll /health until 200; fail with the log if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"sim exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        pytest.fail(f"sim not healthy after {timeout} s:\n{self.log()}")

    def get(self, path: str) -> httpx.Response:
        """GET ``path``."""
        return httpx.get(f"{self.url}{path}", timeout=10.0)

    def post(self, path: str, body: dict) -> httpx.Response:
        """POST JSON ``body`` to ``path``."""
        return httpx.post(f"{self.url}{path}", json=body, timeout=30.0)

    def stop(self) -> None:
        """Terminate the process (kill if it lingers)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def launch(log_dir: Path, argv: list[str], env: dict[str, str] | None = None, *,
           port: int | None = None, log_name: str | None = None) -> Sim:
    """Start ``python -m workers.sim`` with ``argv`` (host/port added) and sim env knobs, its
    output in ``log_dir/log_name`` (``sim-PORT.log`` by default); the caller's ``FLEET_*``
    variables are left out."""
    port = port or free_port()
    full_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FLEET_")},
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "FLEET_SIM_STARTUP_S": "0.1",
        "FLEET_SIM_SEED": "7",
        **(env or {}),
    }
    log_path = log_dir / (log_name or f"sim-{port}.log")
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers.sim",
                *argv,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Sim(proc, f"http://127.0.0.1:{port}", log_path)
