"""One engine's state as one JSON object: NVML, /server_info, /v1/loads, /metrics, log, client.

Every section is optional when reading; a section that could not be captured is absent and
``unavailable`` says why. A snapshot can also be read from a folder of raw captures
(``engine.log``, ``metrics.txt``, ``server_info.json``, ``loads.json``, ``gpu.json``,
``client.json``, ``profile.json``, ``job.json`` (the running job's lengths), ``config.json``
(the model's own, so a diagnosis made off the node can plan), and ``samples.jsonl``: one
``/v1/loads`` + ``sglang:`` gauge reading a line, taken under load), which is how evidence
copied off a real machine is fed in. A captured snapshot carries the model's config.json as
``model_config`` (``{"source", "config", "index_total"}``).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from workers.engine.model_config import ModelConfigError, find_config, index_total
from workers.tune import gpu

Snapshot = dict[str, Any]

# Batch lines kept from the engine log (the startup lines of the latest start are all kept).
LOG_BATCH_LINES = 400
# Earlier starts kept (each as its scheduler line and last decode lines).
HISTORY_STARTS = 4
HISTORY_DECODE_LINES = 100

RAW_FILES = {
    "log": "engine.log",
    "metrics": "metrics.txt",
    "server_info": "server_info.json",
    "loads": "loads.json",
    "gpu": "gpu.json",
    "client": "client.json",
    "profile": "profile.json",
    "samples": "samples.jsonl",
    "job": "job.json",
    "model_config": "config.json",
}


class SnapshotError(ValueError):
    """A snapshot file cannot be read."""


@dataclass(frozen=True)
class Target:
    """Where to find one GPU's engine and its log."""

    gpu: int
    base_url: str
    log_path: Path
    timeout_s: float = 5.0
    # Every GPU of the engine's group (workers/node/gpu_group.py); () means (gpu,).
    gpus: tuple[int, ...] = ()


def read_log(path: Path) -> str:
    """The latest start's startup lines and recent batch lines, after the earlier starts' gist.

    The worker appends every restart to the same file, and a long run writes megabytes of
    batch lines, so the file is streamed once and only what the tuner reads is kept: of each
    earlier start (a canary relaunch, say) its first ``Load weight begin`` line, its scheduler
    line and its last decode lines, which measured the engine at that start's running cap.
    """
    history: deque[str] = deque(maxlen=HISTORY_STARTS)
    startup: list[str] = []
    batches: deque[str] = deque(maxlen=LOG_BATCH_LINES)
    started = False  # the scheduler line of the current start has been seen
    with path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if "Load weight begin" in line and started:
                history.append(_gist(startup, batches))
                startup, started = [], False
                batches.clear()
            if "Decode batch" in line or "Prefill batch" in line:
                batches.append(line)
            elif not started:
                startup.append(line)
            started = started or "max_total_num_tokens=" in line
    return "".join(history) + "".join(startup) + "".join(batches)


def _gist(startup: list[str], batches: deque[str]) -> str:
    """An earlier start, cut to what measures it: first weight line, scheduler, decode lines."""
    begin = next((x for x in startup if "Load weight begin" in x), "")
    scheduler = next((x for x in startup if "max_total_num_tokens=" in x), "")
    decode = [x for x in batches if "Decode batch" in x][-HISTORY_DECODE_LINES:]
    return begin + scheduler + "".join(decode)


def _get(client: httpx.Client, path: str) -> httpx.Response:
    response = client.get(path)
    response.raise_for_status()
    return response


def _engine_sections(target: Target, out: Snapshot, why: dict[str, str]) -> None:
    fetches: dict[str, tuple[str, Callable[[httpx.Response], Any]]] = {
        "server_info": ("/server_info", lambda r: r.json()),
        "loads": ("/v1/loads?include=all", lambda r: r.json()),
        "metrics": ("/metrics", lambda r: r.text),
    }
    with httpx.Client(base_url=target.base_url, timeout=target.timeout_s) as client:
        for section, (path, decode) in fetches.items():
            try:
                out[section] = decode(_get(client, path))
            except (httpx.HTTPError, ValueError) as exc:
                why[section] = f"GET {target.base_url}{path}: {exc}"


def capture(
    target: Target,
    client: dict[str, Any] | None = None,
    profile: dict[str, Any] | None = None,
    job: dict[str, Any] | None = None,
) -> Snapshot:
    """Capture every section available for ``target`` right now (``job``: the running job's
    lengths, workers/tune/job_lengths.py)."""
    out: Snapshot = {"captured_at": time.time(), "gpu_index": target.gpu}
    why: dict[str, str] = {}
    section, reason = gpu.read_group_section(target.gpus or (target.gpu,))
    if section is not None:
        out["gpu"] = section
    else:
        why["gpu"] = reason or "unknown"
    _engine_sections(target, out, why)
    try:
        out["log"] = read_log(target.log_path)
    except OSError as exc:
        why["log"] = f"{target.log_path}: {exc}"
    for name, value in (("client", client), ("profile", profile), ("job", job)):
        if value is not None:
            out[name] = value
        else:
            why[name] = "not available"
    model_path = ((profile or {}).get("flags") or {}).get("model-path")
    try:
        out["model_config"] = model_config_section(str(model_path or ""))
    except ModelConfigError as exc:
        why["model_config"] = str(exc)
    out["unavailable"] = why
    return out


def model_config_section(model_path: str) -> dict[str, Any]:
    """The model's config.json (and its weights' ``total_size`` where the index is beside
    it), as the snapshot carries it: a diagnosis made elsewhere plans from it."""
    if not model_path:
        raise ModelConfigError("no model-path in the engine's profile")
    path = find_config(model_path)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path}: cannot read ({exc})") from exc
    return {"source": str(path), "config": config, "index_total": index_total(path.parent)}


def _read_folder(folder: Path) -> Snapshot:
    out: Snapshot = {}
    for section, name in RAW_FILES.items():
        path = folder / name
        if not path.exists():
            continue
        text = path.read_text()
        if section == "model_config":
            out[section] = {"source": str(path), "config": json.loads(text)}
        elif name.endswith(".jsonl"):
            out[section] = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            out[section] = json.loads(text) if name.endswith(".json") else text
    return out


def load(path: Path) -> Snapshot:
    """Read a snapshot from a JSON file or a folder of raw captures."""
    try:
        if path.is_dir():
            return _read_folder(path)
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{path}: {exc}") from exc
    if not isinstance(data, dict):
        raise SnapshotError(f"{path}: a snapshot is a JSON object")
    return data


def save(snapshot: Snapshot, path: Path) -> None:
    """Write ``snapshot`` as indented JSON."""
    path.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
