"""The GPU check's reach into the engines: GPUs, caps, SIGKILL of one, start-up captures."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx

from bench.gpu_configs import gpu_memory_used_mib


def visible_gpus() -> int:
    """GPUs nvidia-smi lists (CUDA_VISIBLE_DEVICES is the workers' business, not ours)."""
    return len(gpu_memory_used_mib())


def engine_loads(url: str) -> dict[str, Any]:
    """``/v1/loads`` entry of one engine (its effective cap and pool)."""
    return httpx.get(f"{url}/v1/loads", timeout=10).json()["loads"][0]


def kill_engine(gpu: int) -> int | None:
    """SIGKILL the process group of the engine guard of ``gpu`` (the engine dies at once)."""
    out = subprocess.run(["pgrep", "-f", "workers.engine.guard"], capture_output=True,
                         text=True).stdout.split()
    for pid in map(int, out):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"CUDA_VISIBLE_DEVICES={gpu}".encode() in env or len(out) == 1:
            os.killpg(pid, signal.SIGKILL)
            return pid
    return None


def capture_startup(url: str, out: Path, stamp: str) -> list[str]:
    """GPU 0's ``/server_info``, ``/v1/loads`` and ``/metrics`` as the healthy engine first
    answers them, kept beside the summary (what the fleet's readers parse, per release)."""
    kept = []
    for path, name in (("/server_info", "server_info.json"), ("/v1/loads", "v1_loads.json"),
                       ("/metrics", "metrics.txt")):
        try:
            body = httpx.get(f"{url}{path}", timeout=10).text
        except httpx.HTTPError as exc:
            body = f"error: {exc!r}"
        (out / f"gpu-check-{stamp}-{name}").write_text(body)
        kept.append(f"gpu-check-{stamp}-{name}")
    return kept
