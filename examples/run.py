"""Run a recipe of docs/recipes.md on the simulator, start to verified data set, in one command.

``python -m examples.run best_of_n`` (or ``tool_use``, ``extraction``, ``all``) starts what a
user runs on a GPU node, with the SGLang simulator as the engine: ``redis-server`` on a free
port, one worker (``celery -A workers worker -Q gpu0``, the ``qwen36-27b-tools`` profile: the
27B profile plus SGLang's tool-call parser), then for each recipe ``fleet enqueue`` with the
recipe's flags, ``fleet status`` until done, ``fleet verify --json``, ``fleet sink --local``,
and the recipe's own step over the data set (``check`` below). Everything lives under
``.examples/`` and every process it started is stopped. Exit 0 when every recipe verified
exactly (every sample once) and its check passed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq

from producer.localfleet import free_port_block, start_redis, start_worker, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
WORK = ROOT / ".examples"
PROFILE = "qwen36-27b-tools"


def _best_of_n(rows: list[dict[str, Any]]) -> str | None:
    """Best-of-N against the kept reference column: per question, the samples whose answer
    contains the reference; every question must have its 4 samples beside its reference."""
    by_q: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_q.setdefault(r["id"], []).append(r)
    for qid, samples in sorted(by_q.items()):
        ref = samples[0]["answer"]
        right = [s["sample"] for s in samples if ref in (s["completion"] or "")]
        best = right[0] if right else None
        print(f"  {qid:>4} [{samples[0]['source']}/{samples[0]['difficulty']}] reference "
              f"{ref!r}: {len(right)}/{len(samples)} samples match, best-of-N: {best}")
        if sorted(s["sample"] for s in samples) != [0, 1, 2, 3]:
            return f"{qid} does not have samples 0..3"
        if any(s["answer"] != ref for s in samples):
            return f"{qid}: the kept reference differs between its samples"
    return None


def _tool_use(rows: list[dict[str, Any]]) -> str | None:
    """Tool calls stored as JSON beside the content; tool_choice "none" never calls."""
    for r in sorted(rows, key=lambda x: x["id"]):
        calls = orjson.loads(r["tool_calls"]) if r["tool_calls"] else []
        names = [c["function"]["name"] for c in calls]
        print(f"  {r['id']}: finish {r['finish_reason']}, tool calls {names or 'none'}"
              + (f" {calls[0]['function']['arguments']}" if calls else ""))
    none = next(r for r in rows if r["id"] == "tool-4")  # tool_choice "none"
    if none["tool_calls"] is not None:
        return "tool_choice 'none' came back with tool calls"
    if not all(r["tool_calls"] for r in rows if r["id"] in ("tool-1", "tool-3", "tool-5")):
        return "a row whose tool_choice requires a call has no tool_calls"
    return None


def _extraction(rows: list[dict[str, Any]]) -> str | None:
    """Every answer is JSON with the schema's required keys, on both routes."""
    for r in sorted(rows, key=lambda x: x["id"]):
        doc = orjson.loads(r["completion"])
        print(f"  {r['id']}: {r['text'][:40]!r}... -> {doc}")
        missing = {"name", "company", "role"} - set(doc)
        if missing:
            return f"{r['id']}: the answer lacks {sorted(missing)}"
    return None


# name: (input, enqueue flags, the recipe's step over the data set rows)
RECIPES: dict[str, tuple[str, list[str], Callable[[list[dict[str, Any]]], str | None]]] = {
    "best_of_n": ("best_of_n/questions.jsonl",
                  ["--prompt-column", "question", "--chat", "--samples", "4",
                   "--temperature", "0.8", "--sampling", "seed=1",
                   "--keep-columns", "answer,source,difficulty", "--max-new-tokens", "512"],
                  _best_of_n),
    "tool_use": ("tool_use/rows.jsonl", ["--keep-columns", "task"], _tool_use),
    "extraction": ("extraction/rows.jsonl", ["--keep-columns", "text"], _extraction),
}


def _producer(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _recipe(env: dict[str, str], name: str) -> bool:
    src, flags, check = RECIPES[name]
    print(f"\n== {name}: fleet enqueue examples/{src} --job {name} {' '.join(flags)}")
    res = _producer(env, "enqueue", str(HERE / src), "--job", name, *flags)
    if res.returncode != 0:
        print(res.stderr)
        return False
    while not orjson.loads(_producer(env, "status", "--job", name, "--json").stdout)["done"]:
        time.sleep(0.5)
    report = orjson.loads(_producer(env, "verify", "--job", name, "--json").stdout)
    print(f"  verify: expected {report['expected']} (prompts {report['prompts']}, samples "
          f"{report['samples']}), missing {report['missing']}, duplicates "
          f"{report['duplicates']}, ok {report['ok']}")
    if _producer(env, "sink", "--job", name, "--local").returncode != 0:
        return False
    path = _producer(env, "dataset-path", "--job", name).stdout.strip()
    rows = pq.read_table(path).to_pylist()
    problem = check(rows)
    print(f"  data set: {path} ({len(rows)} rows); check: {problem or 'ok'}")
    return bool(report["ok"]) and problem is None


def main(argv: list[str]) -> int:
    """Run the named recipes (``all``: every one) on one simulated worker."""
    names = list(RECIPES) if argv in ([], ["all"]) else argv
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        print(f"unknown recipe {unknown[0]!r}; one of: {', '.join(RECIPES)}, all")
        return 2
    shutil.rmtree(WORK, ignore_errors=True)
    server = start_redis(WORK / "redis")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update({
        "FLEET_REDIS_URL": server.url, "FLEET_STORE_URL": (WORK / "store").as_uri(),
        "FLEET_ALLOW_NODE_LOCAL_STORE": "1", "FLEET_ENGINE": "sim", "FLEET_PROFILE": PROFILE,
        "FLEET_ENGINE_BASE_PORT": str(free_port_block(8)),
        "FLEET_METRICS_BASE_PORT": str(free_port_block(8)), "FLEET_LOG_DIR": str(WORK / "logs"),
        "FLEET_SIM_SPEED": "20", "FLEET_SIM_MEAN_OUTPUT_TOKENS": "60",
        "FLEET_SIM_STARTUP_S": "0.2", "FLEET_SINK_AUTO": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    })
    worker = start_worker(0, env, WORK / "logs", node="gpu0@examples", cwd=ROOT)
    try:
        wait_healthy(server.client(), [worker], timeout_s=120)
        results = {name: _recipe(env, name) for name in names}
    finally:
        worker.stop(grace_s=20)
        server.stop()
    print("\n" + ", ".join(f"{n}: {'ok' if ok else 'FAILED'}" for n, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
