"""The runner of one schedule (tests/chaos/schedule.py).

It starts a :class:`~tests.chaos.cluster.Cluster`, enqueues a main and a side job, plays the
steps while a supervisor thread restarts dead workers, then settles (thaw, store back), runs
the documented remedy (``resume`` a paused or cancelled job, then ``enqueue`` the same file
again, wait until done) and checks :mod:`tests.chaos.invariants`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import redis

from tests.chaos import actions, faults, invariants
from tests.chaos.cluster import Cluster
from tests.chaos.feed import StatusFeed
from tests.chaos.schedule import MAIN, SIDE, TOO_LONG, Schedule, Shape, Step
from tests.conftest import run_producer, write_prompts

if TYPE_CHECKING:
    from tests.s3fixture import MotoServer

REPLAY = "FLEET_SCHEDULE_SEED={seed} .venv/bin/python -m pytest tests/test_schedule.py -k replay"
SIDE_SAMPLES = 3


# --- the runner --------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one schedule did and found."""

    schedule: Schedule
    log: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    prompts: int = 0
    lost: int = 0
    duplicated: int = 0
    seconds: float = 0.0
    splits: int = 0  # parts idle GPUs took from other GPUs' batches (status's ``splits``)

    @property
    def ok(self) -> bool:
        """No invariant was violated."""
        return not self.violations

    @property
    def faults(self) -> int:
        """Fault steps in the schedule."""
        return sum(s.is_fault for s in self.schedule.steps)

    @property
    def actions(self) -> int:
        """Operator actions in the schedule."""
        return sum(not s.is_fault for s in self.schedule.steps)

    def replay(self) -> str:
        """The command that replays this schedule."""
        return REPLAY.format(seed=self.schedule.seed)

    def report(self) -> str:
        """Schedule, what each step did, violations and the replay command."""
        lines = [self.schedule.describe(), "what happened:", *(f"  {x}" for x in self.log)]
        if self.violations:
            lines += ["VIOLATIONS:", *(f"  {v}" for v in self.violations),
                      f"replay: {self.replay()}"]
        return "\n".join(lines)


class Supervisor(threading.Thread):
    """Restarts dead workers every few tenths of a second while the schedule runs, and logs
    when each job first has every batch done."""

    def __init__(self, cluster: Cluster, lock: threading.Lock, log: list[str], t0: float,
                 n_batches: dict[str, int]) -> None:
        super().__init__(name="chaos-supervisor", daemon=True)
        self.cluster, self.lock, self.log, self.t0 = cluster, lock, log, t0
        self.waiting = dict(n_batches)
        self.stopped = threading.Event()

    def say(self, what: str) -> None:
        """Log ``what`` with the time since the job started."""
        self.log.append(f"t+{time.monotonic() - self.t0:5.1f}s {what}")

    def _watch_jobs(self) -> None:
        client = self.cluster.client()
        try:
            for job, n in list(self.waiting.items()):
                if client.scard(f"fleet:job:{job}:done") >= n:
                    del self.waiting[job]
                    self.say(f"{job}: every batch marked done")
        except redis.RedisError:
            pass  # Redis restarting: look again next round
        finally:
            client.close()

    def run(self) -> None:
        """Supervise until stopped."""
        while not self.stopped.wait(0.3):
            with self.lock:
                for gpu in self.cluster.supervise():
                    self.say(f"supervisor restarted worker gpu{gpu}")
            self._watch_jobs()


def _inputs(root: Path, shape: Shape) -> dict[str, Path]:
    main = write_prompts(root / "main.jsonl", shape.prompts)
    with main.open("ab") as fh:
        for k in range(shape.too_long):
            fh.write(orjson.dumps({"id": f"long{k}", "prompt": TOO_LONG}) + b"\n")
    side = root / "side.jsonl"  # N samples per prompt, with a kept column (issue 27)
    with side.open("wb") as fh:
        for i in range(shape.side_prompts):
            fh.write(orjson.dumps({"id": f"s{i}", "prompt": f"Side question {i}: why?",
                                   "ref": i}) + b"\n")
    return {MAIN: main, SIDE: side}


# The side job asks for several samples per prompt and keeps an input column: every fault and
# the remedy (a plain re-run of enqueue, which reads the job's recorded options) apply to it.
JOB_FLAGS = {SIDE: ["--samples", str(SIDE_SAMPLES), "--temperature", "0.7",
                    "--keep-columns", "ref"]}


def _do(step: Step, cluster: Cluster, inputs: dict[str, Path]) -> str:
    if step.is_fault:
        return faults.FAULTS[step.kind](cluster, **step.args)
    return actions.ACTIONS[step.kind](cluster, inputs, **step.args)


def _play(schedule: Schedule, cluster: Cluster, inputs: dict[str, Path], out: Outcome,
          lock: threading.Lock, t0: float) -> None:
    for step in schedule.steps:
        time.sleep(max(0.0, t0 + step.at_s - time.monotonic()))
        with lock:
            try:
                said = _do(step, cluster, inputs)
            except Exception as exc:  # the harness must not stop on a step that could not act
                said = f"step raised {type(exc).__name__}: {exc}"
        out.log.append(f"t+{time.monotonic() - t0:5.1f}s {step.kind}: {said}")


def _job_state(cluster: Cluster, job: str) -> str:
    res = run_producer(cluster.env, "jobs", "--json")
    rows = orjson.loads(res.stdout) if res.returncode == 0 else []
    return next((x["state"] for x in rows if x["job"] == job), "unknown")


def _remedy(cluster: Cluster, inputs: dict[str, Path], out: Outcome) -> list[str]:
    """Resume what is paused or cancelled, enqueue every job again, wait until done; return
    the jobs that did not finish."""
    unfinished, n_batches = [], out.schedule.shape.n_batches()
    for job, path in inputs.items():
        state = _job_state(cluster, job)
        stuck = invariants.stranded(cluster, job, n_batches[job])
        if stuck:
            out.log.append(f"before the remedy: {job} ({state}) batches not stored with no "
                           f"message and no live holder: {stuck}")
        if state in ("paused", "cancelled"):
            out.log.append(f"remedy: {job} was {state}: {actions.resume(cluster, inputs, job)}")
        res = run_producer(cluster.env, "enqueue", str(path), "--job", job, timeout_s=120)
        out.log.append(f"remedy: enqueue {job} rc={res.returncode}: "
                       f"{res.stderr.strip().splitlines()[-1:]}")
    for job in _wait_all_done(cluster, list(inputs), out.schedule.shape, out):
        unfinished.append(job)
        stuck = invariants.stranded(cluster, job, n_batches[job])
        if stuck:
            out.violations.append(f"{job}: batches not stored with no message and no live "
                                  f"holder: {stuck}")
    return unfinished


def _status(cluster: Cluster, job: str) -> dict[str, Any] | None:
    """``status --json`` of ``job``; None if the command failed."""
    res = run_producer(cluster.env, "status", "--job", job, "--json")
    return orjson.loads(res.stdout) if res.returncode == 0 else None


def _wait_all_done(cluster: Cluster, jobs: list[str], shape: Shape, out: Outcome) -> list[str]:
    """Follow every job's status until it is done; a job whose counters stand still for
    ``stall_s`` (or that is not done after ``done_timeout_s``) is given up on. Returns the
    jobs not done."""
    start = time.monotonic()
    last: dict[str, tuple[Any, ...] | None] = dict.fromkeys(jobs)
    moved = dict.fromkeys(jobs, start)
    feeds = {job: StatusFeed(cluster.env, job) for job in jobs}
    try:
        while feeds:
            now = time.monotonic()
            for job in list(feeds):
                st = feeds[job].latest()
                seen = None if st is None else (st["done"], st["completed"], st["failed"],
                                                st["done_batches"])
                if seen is not None and seen[0]:
                    feeds.pop(job).stop()
                    continue
                if seen != last[job]:
                    last[job], moved[job] = seen, now
                if now - moved[job] > shape.stall_s or now - start > shape.done_timeout_s:
                    feeds.pop(job).stop()
                    out.violations.append(
                        f"{job}: not done after the remedy: no progress for "
                        f"{now - moved[job]:.0f} s ({now - start:.0f} s in all); last status "
                        f"(done, completed, failed, done_batches) = {seen}")
            time.sleep(1.0)
    finally:
        for feed in feeds.values():
            feed.stop()
    return [j for j in jobs if any(v.startswith(f"{j}: not done") for v in out.violations)]


def _quiesce(cluster: Cluster, jobs: list[str], timeout_s: float = 30.0) -> None:
    """Wait until ``status`` shows no batch of ``jobs`` in flight (late runs have finished)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = [j for j in jobs if (st := _status(cluster, j)) is None
                or st.get("in_flight_batches")]
        if not busy:
            return
        time.sleep(0.5)


def _check(cluster: Cluster, schedule: Schedule, inputs: dict[str, Path], out: Outcome,
           unfinished: list[str]) -> None:
    store, n_batches = cluster.store(), schedule.shape.n_batches()
    for job in inputs:
        viol, report = invariants.check_verify(cluster, job)
        out.violations += viol
        out.prompts += int(report.get("expected", 0))
        out.lost += int(report.get("missing", 0))
        out.duplicated += int(report.get("duplicates", 0))
        rows = invariants.stored_rows(store, job)
        out.violations += invariants.check_counters(cluster, job, rows, n_batches[job])
        if job in JOB_FLAGS:  # the kept column rides with every sample
            wrong = sorted({x["index"] for b in rows.values() for x in b
                            if (x.get("keep") or {}).get("ref") != x["index"]})
            if wrong:
                out.violations.append(f"{job}: rows without their kept 'ref': {wrong[:5]}")
        st = _status(cluster, job)
        if st is not None:
            out.splits += st["splits"]["parts"]
            out.log.append(f"{job}: {st['splits']['parts']} parts split off "
                           f"({st['splits']['rows']} rows)")
        if job in unfinished:
            continue
        stuck = invariants.stranded(cluster, job, n_batches[job])
        if stuck:
            out.violations.append(f"{job}: done, yet batches not stored with no message and "
                                  f"no live holder: {stuck}")
        if not viol:
            manifest = invariants.check_manifest(cluster, job, rows,
                                                 schedule.shape.manifest_wait_s)
            out.violations += manifest
            if not manifest:
                out.violations += invariants.check_export(
                    cluster, job, rows, "ref" if job in JOB_FLAGS else None)


def run_schedule(schedule: Schedule, base_env: dict[str, str], root: Path,
                 moto: MotoServer | None) -> Outcome:
    """Run ``schedule`` on a fresh cluster under ``root``; see the module docstring."""
    started = time.monotonic()
    out = Outcome(schedule)
    shape = schedule.shape
    cluster = Cluster.start(root, base_env, list(range(shape.gpus)),
                            moto if schedule.store == "s3" else None, shape.worker_env())
    lock = threading.Lock()
    supervisor = None
    try:
        inputs = _inputs(root, shape)
        for job, path in inputs.items():
            res = run_producer(cluster.env, "enqueue", str(path), "--job", job, "--batch-size",
                               str(shape.batch_size), *JOB_FLAGS.get(job, []))
            assert res.returncode == 0, res.stderr
        t0 = time.monotonic()  # the main job's batches were sent when its enqueue ended
        supervisor = Supervisor(cluster, lock, out.log, t0, shape.n_batches())
        supervisor.start()
        _play(schedule, cluster, inputs, out, lock, t0)
        with lock:
            cluster.heal()
        time.sleep(shape.settle_s)
        supervisor.say("schedule over, faults healed: remedy")
        unfinished = _remedy(cluster, inputs, out)
        _quiesce(cluster, list(inputs))
        supervisor.say("remedy over: checks")
        _check(cluster, schedule, inputs, out, unfinished)
        supervisor.stopped.set()
        supervisor.join()
        with lock:
            cluster.stop_workers()
        supervisor.say("workers stopped: orphan check")
        out.violations += invariants.check_orphans(cluster, wait_s=10.0)
    finally:
        if supervisor is not None:
            supervisor.stopped.set()
        cluster.teardown()
        out.seconds = time.monotonic() - started
    return out
