"""Start real SGLang once per configuration through the fleet's engine lifecycle; keep what it said.

Runs on a GPU node where ``.[gpu]`` is installed (or on the borrowed H200 through
``tools/gpu_machine_check.sh``). For each configuration of a JSON file
(``{"name": {"model": "<folder or hub id>", "flags": {...}, "env": {...}}}``) it starts the engine
with :class:`workers.engine.lifecycle.Engine` (guard, process group, health wait, version
check), times the start, saves ``/server_info``, ``/v1/loads``, ``/get_model_info`` and
``/metrics`` and one short ``/generate``, stops the engine and reads the GPU's used memory
after the stop. What the engine logged is its ``server.log``. These are the captures the
capacity tests check the pool arithmetic against (``tests/fixtures/sglang/<version>/``).

    python -m bench.gpu_configs --configs bench/gpu_configs.json --out /tmp/configs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from config.launch_profile import LaunchProfile
from workers.engine.lifecycle import Engine, EngineSpec
from workers.errors import EngineStartFailed


def gpu_memory_used_mib() -> list[int]:
    """Used memory of every visible GPU, from nvidia-smi (empty where there is none)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                              "nounits"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(v) for v in out.split() if v.strip().isdigit()]


def _save(http: httpx.Client, path: str, dest: Path, method: str = "GET",
          body: dict | None = None) -> None:
    try:
        resp = http.request(method, path, json=body, timeout=60)
        dest.write_text(f"STATUS: {resp.status_code}\n\n{resp.text}")
    except httpx.HTTPError as exc:
        dest.write_text(f"ERROR: {exc!r}\n")


def capture(name: str, config: dict, out: Path, port: int, engine: str, timeout_s: float,
            deadline: float) -> dict:
    """Start, capture and stop one configuration; returns its summary."""
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    flags = {"model-path": config["model"], **config.get("flags", {})}
    profile = LaunchProfile(name=name, flags=flags, env=config.get("env", {}))
    spec = EngineSpec(kind=engine, profile=profile, gpu=0, host="127.0.0.1", port=port,
                      log_path=d / "server.log")
    (d / "argv.txt").write_text(" ".join(spec.argv()) + "\n")
    summary: dict = {"name": name, "flags": flags, "memory_before_mib": gpu_memory_used_mib()}
    eng = Engine(spec)
    t0 = time.monotonic()
    eng.start()
    try:
        eng.wait_ready(min(timeout_s, max(deadline - time.monotonic(), 1)))
        summary["healthy_after_s"] = round(time.monotonic() - t0, 1)
        with httpx.Client(base_url=spec.base_url) as http:
            for path in ("/server_info", "/v1/loads", "/get_model_info", "/metrics"):
                _save(http, path, d / f"{path.strip('/').replace('/', '_')}.txt")
            _save(http, "/generate", d / "generate.txt", "POST",
                  {"text": "Hello", "sampling_params": {"max_new_tokens": 8}})
    except EngineStartFailed as exc:
        summary["error"] = str(exc)
    finally:
        eng.stop()
        time.sleep(3)
        summary["memory_after_stop_mib"] = gpu_memory_used_mib()
    (d / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Capture every configuration of ``--configs`` that fits in ``--budget-s``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--configs", type=Path, required=True)
    ap.add_argument("--only", nargs="*", help="names to run (default: all, in file order)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--engine", default="sglang", choices=("sglang", "sim"))
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--budget-s", type=float, default=480,
                    help="stop starting configurations this many seconds after the start")
    ap.add_argument("--min-left-s", type=float, default=100,
                    help="skip a configuration with less than this left of the budget")
    args = ap.parse_args(argv)
    configs = json.loads(args.configs.read_text())
    deadline = time.monotonic() + args.budget_s
    results = []
    for name in args.only or list(configs):
        left = deadline - time.monotonic()
        if left < args.min_left_s:
            print(f"skip {name}: {left:.0f} s left", flush=True)
            continue
        res = capture(name, configs[name], args.out, args.port, args.engine, args.timeout_s,
                      deadline)
        results.append(res)
        print(json.dumps(res), flush=True)
    (args.out / "configs.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0 if results and all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
