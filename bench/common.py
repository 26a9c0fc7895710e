"""What every benchmark shares: goals and the verdict table, prompt files, CPU clocks, a fleet.

A benchmark starts the same processes a user runs (``redis-server``, ``celery -A workers worker
-Q gpuN`` owning a simulated engine, ``python -m producer ...``) through
:mod:`producer.localfleet`, measures, prints each figure beside its goal and exits 1 when a goal
is missed. Ratios are measured within one run because this machine is shared and noisy.
"""

from __future__ import annotations

import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import orjson
import redis

from producer.localfleet import (
    RedisServer,
    WorkerProcess,
    free_port_block,
    start_redis,
    start_worker,
    stop_workers,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[1]
PROFILE = "qwen36-27b"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The workload (docs/workload.md): mean output ~2,490 tokens, long tail up to the
# context (8,192); jobs are run with --max-new-tokens 7000 (docs/sglang.md), the sim's
# default sigma.
WORKLOAD_MEAN_TOKENS = 2490
WORKLOAD_MAX_NEW_TOKENS = 7000
# The simulator's default log-normal shape (config.settings.SimSettings.output_sigma).
WORKLOAD_SIGMA = 0.8


def capped_mean_tokens(mean: float = WORKLOAD_MEAN_TOKENS, sigma: float = WORKLOAD_SIGMA,
                       cap: float = WORKLOAD_MAX_NEW_TOKENS) -> float:
    """E[min(X, cap)] for the simulator's log-normal X with this mean (tokens per request)."""
    mu = math.log(mean) - sigma * sigma / 2

    def phi(z: float) -> float:
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    z = (math.log(cap) - mu) / sigma
    return mean * phi(z - sigma) + cap * (1 - phi(z))


@dataclass(frozen=True)
class Goal:
    """One measured figure and its goal."""

    name: str
    measured: float
    target: float
    unit: str = ""
    at_most: bool = False  # True: the figure must stay at or below the target

    @property
    def ok(self) -> bool:
        """Whether the goal is met."""
        return self.measured <= self.target if self.at_most else self.measured >= self.target


def _fmt(value: float, unit: str) -> str:
    """A figure with its unit, precision chosen by size."""
    text = f"{value:,.3f}" if abs(value) < 10 else f"{value:,.0f}"
    return f"{text} {unit}".rstrip()


def verdict(title: str, goals: list[Goal]) -> int:
    """Print the goals beside the measured figures; 0 when all are met, else 1."""
    print(f"\n== {title} ==  ({time.strftime('%Y-%m-%d %H:%M')}, {machine()})")
    width = max(len(g.name) for g in goals)
    for g in goals:
        op = "<=" if g.at_most else ">="
        mark = "ok" if g.ok else "MISSED"
        print(f"  {g.name:<{width}}  measured {_fmt(g.measured, g.unit):>16}   "
              f"goal {op} {_fmt(g.target, g.unit):<14} {mark}")
    missed = [g for g in goals if not g.ok]
    print(f"  -> {'all goals met' if not missed else f'{len(missed)} goal(s) missed'}")
    sys.stdout.flush()
    return 1 if missed else 0


def machine() -> str:
    """One line naming this machine: CPU model, cores, memory."""
    model = "cpu"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return f"{platform.node()}, {model}, {os.cpu_count()} cores, {mem_kib / 2**20:.0f} GiB"


def note(message: str) -> None:
    """One progress line on stdout (flushed: make bench shows it live)."""
    print(f"  [{time.strftime('%H:%M:%S')}] {message}")
    sys.stdout.flush()


# --- prompts ---------------------------------------------------------------------------------

def _corpus(rng: random.Random, chars: int) -> str:
    """Text of random words from a 5,000-word vocabulary (compresses about like prose)."""
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    vocab = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(5000)]
    words: list[str] = []
    size = 0
    while size < chars:
        words.append(rng.choice(vocab))
        size += len(words[-1]) + 1
    return " ".join(words)


def write_chat_prompts(path: Path, n: int, pad_to_bytes: int = 0, seed: int = 1) -> Path:
    """A JSONL file of ``n`` short chat prompts (padded with varied text to ``pad_to_bytes``)."""
    rng = random.Random(seed)
    corpus = _corpus(rng, 4 * 2**20) if pad_to_bytes else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb", buffering=8 * 2**20) as fh:
        for i in range(n):
            text = f"Question {i}: explain step by step why idea {i} works."
            line = orjson.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": text}]})
            pad = pad_to_bytes - len(line) - 1
            if pad > 0:
                start = rng.randrange(len(corpus) - pad)
                text += " " + corpus[start:start + pad]
                line = orjson.dumps({"id": f"q{i}",
                                     "messages": [{"role": "user", "content": text}]})
            fh.write(line + b"\n")
    return path


# --- CPU clocks ------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children(pid: int) -> list[int]:
    """Direct children of a process."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(p) for p in path.read_text().split()]
    except FileNotFoundError:
        return []


def cmdline(pid: int) -> str:
    """A process's command line, space separated."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def worker_pids(main_pid: int) -> tuple[list[int], list[int]]:
    """(a worker's own processes: main + pool children, its engine's: guard + engine)."""
    own, engine = [main_pid], []
    for pid in children(main_pid):
        if "workers.engine.guard" in cmdline(pid):
            engine += [pid, *children(pid)]
        else:
            own.append(pid)
    return own, engine


def cpu_of(pids: list[int]) -> float:
    """CPU seconds used so far by ``pids`` together."""
    return sum(cpu_seconds(p) for p in pids)


class MachineCpu:
    """Busy fraction of the whole machine between two reads of /proc/stat."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = values[3] + values[4]
        return sum(values) - idle, sum(values)

    def busy(self) -> float:
        """Fraction of all cores busy since construction (0..1)."""
        busy, total = self._read()
        return (busy - self._start[0]) / max(total - self._start[1], 1)


# --- the fleet -------------------------------------------------------------------------------

@dataclass
class Fleet:
    """One redis-server plus GPU workers (real celery processes with simulated engines)."""

    workdir: Path
    redis_server: RedisServer
    base_env: dict[str, str]
    workers: list[WorkerProcess] = field(default_factory=list)

    @cached_property
    def r(self) -> redis.Redis:
        """A client of the fleet's Redis."""
        return self.redis_server.client()

    def env(self, **overrides: str) -> dict[str, str]:
        """Environment of producer and workers, with ``overrides`` on top."""
        return {**self.base_env, **overrides}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the workers, their engines and Redis."""
        own, engine = [], []
        for w in self.workers:
            pids = worker_pids(w.proc.pid)
            own += pids[0]
            engine += pids[1]
        return {"workers": cpu_of(own), "engines": cpu_of(engine),
                "redis": cpu_seconds(self.redis_server.proc.pid)}

    def engine_url(self, gpu: int) -> str:
        """HTTP root of the engine owned by the worker of ``gpu``."""
        return f"http://127.0.0.1:{int(self.base_env['FLEET_ENGINE_BASE_PORT']) + gpu}"

    def start_workers(self, n: int, timeout_s: float = 180, **env: str) -> list[WorkerProcess]:
        """Start workers for GPUs 0..n-1 (engine seed differs per GPU) and wait for health."""
        merged = self.env(**env)
        seed = int(merged.get("FLEET_SIM_SEED", "1"))
        new = [start_worker(g, {**merged, "FLEET_SIM_SEED": str(seed + g)}, self.workdir / "logs",
                            node=f"gpu{g}@bench{len(self.workers) + g}", cwd=ROOT)
               for g in range(n)]
        self.workers += new
        wait_healthy(self.r, new, timeout_s=timeout_s)
        return new

    def stop_workers(self) -> None:
        """Warm-stop every worker (and so its engine), all at once."""
        stop_workers(self.workers, grace_s=20)
        self.workers = []

    def producer(self, *args: str, timeout_s: float = 600,
                 ok_codes: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
        """Run ``python -m producer ARGS`` as a user would; raise if it exits with another code
        than ``ok_codes``."""
        res = subprocess.run([sys.executable, "-m", "producer", *args], env=self.env(), cwd=ROOT,
                             capture_output=True, text=True, timeout=timeout_s)
        if res.returncode not in ok_codes:
            raise RuntimeError(f"producer {' '.join(args)} failed ({res.returncode}): "
                               f"{res.stderr[-2000:]}")
        return res


@contextmanager
def local_fleet(prefix: str, **env: str) -> Iterator[Fleet]:
    """A Redis and a store under a fresh temp folder; everything is stopped and removed after.

    If the benchmark fails, the worker and engine logs are kept (the path is printed).
    """
    workdir = Path(tempfile.mkdtemp(prefix=f"fleet-bench-{prefix}-"))
    server = start_redis(workdir / "redis")
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    base.update({
        "FLEET_REDIS_URL": server.url,
        "FLEET_STORE_URL": (workdir / "store").as_uri(),
        "FLEET_ALLOW_NODE_LOCAL_STORE": "1",
        "FLEET_ENGINE": "sim",
        "FLEET_PROFILE": PROFILE,
        "FLEET_ENGINE_BASE_PORT": str(free_port_block(8)),
        "FLEET_LOG_DIR": str(workdir / "logs"),
        "FLEET_SIM_STARTUP_S": "0.2",
        "FLEET_SIM_SEED": "1",
        "FLEET_SINK_AUTO": "false",
        # Ours first, then whatever the caller had (a GPU node's SGLang site, say).
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
        **env,
    })
    fleet = Fleet(workdir=workdir, redis_server=server, base_env=base)
    failed = True
    try:
        yield fleet
        failed = False
    finally:
        fleet.stop_workers()
        fleet.r.close()
        server.stop()
        for path in workdir.iterdir():
            if failed and path.name == "logs":
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink()
        if failed:
            print(f"  logs kept in {workdir / 'logs'}", flush=True)
        else:
            workdir.rmdir()


# ``verify``'s exit codes that still mean every row is there once: 0, and 5 (a quality gate
# failed: a bench's synthetic rows are cut at their max_tokens by design; docs/output.md).
VERIFY_ROWS_OK = (0, 5)
