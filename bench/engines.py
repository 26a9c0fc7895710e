"""The engine-side view of a run: the ideal bound, busy running slots over time, token counters.

Occupancy is read from the engines, not from the client (docs/design.md): ``/v1/loads``
``num_running_reqs / max_running_requests`` sampled on every engine, averaged over a window:
the backlog window (from the first request until the last batch of the job has been taken from
the queue) or the whole job (until the last batch is done). Every window starts at the first
sample that sees a running request, and the engines' decode-token counter is read in that same
sample, so no token decoded before the window's start is counted. The ideal bound is the
simulator's own throughput model (:mod:`workers.sim.engine`): every engine at its running cap,
``cap * accept_length`` tokens per step of ``step_ms(cap)`` milliseconds, divided by the speed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import orjson
import redis

from config.launch_profile import load_profile
from config.settings import SimSettings
from workers.delivery.ownership import live_holders
from workers.engine.capacity import EngineFlags, model_shape, plan_capacity
from workers.redisdb.keys import JobKeys
from workers.sim.calibration import B200_WORKLOAD
from workers.sim.engine import accept_length
from workers.sim.flags import parse_args


@dataclass(frozen=True)
class EngineModel:
    """What the simulator's throughput model says one engine can do at most."""

    cap: int
    draft_tokens: int
    speed: float

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per decode step with every running slot busy."""
        return self.cap * accept_length(self.draft_tokens)

    @property
    def ideal_tokens_per_s(self) -> float:
        """Decode tokens per second of one engine held at its running cap."""
        step_ms = B200_WORKLOAD.step_ms(self.cap, 0.0, self.draft_tokens > 0)
        return self.tokens_per_step / (step_ms / 1000) * self.speed


def engine_model(url: str, speed: float) -> EngineModel:
    """Read the effective cap and speculative settings of the engine at ``url``."""
    with httpx.Client(base_url=url, timeout=10) as http:
        loads = http.get("/v1/loads").json()["loads"][0]
        info = http.get("/server_info").json()
    return EngineModel(cap=int(loads["max_running_requests"]),
                       draft_tokens=int(info.get("speculative_num_draft_tokens") or 0),
                       speed=speed)


def planned_engine_model(profile: str, speed: float) -> EngineModel:
    """The engine a launch profile gives, from the same capacity arithmetic the simulator uses."""
    args = parse_args(load_profile(profile).to_argv())
    flags = EngineFlags.from_flags(vars(args), {})
    plan = plan_capacity(model_shape(args.model_path), flags, SimSettings().gpu_memory_mib)
    return EngineModel(cap=plan.max_running_requests, draft_tokens=plan.num_draft_tokens,
                       speed=speed)


def parse_counter(text: str, name: str, label: str = "") -> float:
    """Sum of the Prometheus samples of ``name`` (optionally only those carrying ``label``)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def decode_tokens(http: httpx.Client, urls: list[str]) -> float:
    """Decode-step tokens so far, all engines (``sglang:realtime_tokens_total{mode="decode"}``)."""
    return sum(parse_counter(http.get(f"{url}/metrics").text, "sglang:realtime_tokens_total",
                             'mode="decode"') for url in urls)


@dataclass
class Timeline:
    """What the watcher saw: busy fractions over time and the moments that bound the windows."""

    # (t, busy running slots / all slots, waiting requests summed over engines)
    samples: list[tuple[float, float, int]] = field(default_factory=list)
    t_first: float | None = None  # first sample with a running request: every window's start
    t_started: float | None = None  # first batch taken from the queue
    t_all_taken: float | None = None  # every batch taken from the queue (running or done)
    t_done: float | None = None  # every batch done
    # The job's last row recorded (its ``last_row_at``, on this clock): the moment a plain
    # client's run ends, before the fleet writes the last results.
    t_last_row: float | None = None
    decode_at_start: float | None = None  # decode-token counter, read in the t_first sample
    decode_at_all_taken: float | None = None
    decode_at_done: float | None = None

    def _window(self, whole: bool = False) -> list[tuple[float, float, int]]:
        """Samples from the first request until the last batch was taken (or, ``whole``, was
        done)."""
        if self.t_first is None:
            return []
        end = (self.t_done if whole else self.t_all_taken or self.t_done) or float("inf")
        return [s for s in self.samples if self.t_first <= s[0] <= end]

    def occupancy(self, whole: bool = False) -> float:
        """Mean busy-slot fraction from the first request until the last batch was taken (or,
        ``whole``, until the job was done)."""
        window = self._window(whole)
        return sum(busy for _, busy, _ in window) / len(window) if window else 0.0

    def occupancy_to_last_row(self) -> float:
        """Mean busy-slot fraction from the first request until the job's last row was
        recorded: the window a plain client's occupancy covers (it ends with its last
        response), without the fleet's writing of the last results after it."""
        end = self.t_last_row or self.t_done
        window = [s for s in self._window(whole=True) if end is None or s[0] <= end]
        return sum(busy for _, busy, _ in window) / len(window) if window else 0.0

    def _decode_rate(self, last: float | None, end: float | None) -> float:
        """Engine decode tokens/s from the first request until ``last`` (counter ``end``)."""
        first, start = self.t_first, self.decode_at_start
        if first is None or last is None or start is None or end is None:
            return 0.0
        return (end - start) / max(last - first, 1e-9)

    def whole_decode_rate(self) -> float:
        """Engine decode tokens/s from the first request until the last batch was done."""
        return self._decode_rate(self.t_done, self.decode_at_done)

    @property
    def tail_share(self) -> float:
        """Share of the whole job's time after the last batch was taken (the tail)."""
        if self.t_first is None or self.t_all_taken is None or self.t_done is None:
            return 0.0
        return (self.t_done - self.t_all_taken) / max(self.t_done - self.t_first, 1e-9)

    def mean_waiting(self) -> float:
        """Mean requests queued at the engines over the same window (0: the client ran dry)."""
        window = self._window()
        return sum(waiting for _, _, waiting in window) / len(window) if window else 0.0

    def steady_decode_rate(self) -> float:
        """Engine decode tokens/s from the first request until the last batch was taken."""
        return self._decode_rate(self.t_all_taken, self.decode_at_all_taken)

    @property
    def end_to_end_s(self) -> float:
        """Seconds from the first request until the job was done."""
        if self.t_first is None or self.t_done is None:
            return 0.0
        return self.t_done - self.t_first


def engine_busy(http: httpx.Client, urls: list[str], caps: list[int]) -> tuple[float, int]:
    """(busy running slots / all slots, waiting requests) over every engine, from /v1/loads.
    ``caps`` is updated in place: a relaunched engine (tune apply) has a new cap."""
    running = waiting = 0
    for i, url in enumerate(urls):
        try:
            entry = orjson.loads(http.get(f"{url}/v1/loads").content)["loads"][0]
        except httpx.HTTPError:  # an engine that is down or restarting runs nothing
            continue
        running += int(entry["num_running_reqs"])
        waiting += int(entry["num_waiting_reqs"])
        caps[i] = int(entry.get("max_running_requests") or caps[i])
    return running / sum(caps), waiting


class Poller:
    """A daemon thread that calls :meth:`tick` every ``interval_s`` with one HTTP client, from
    the ``with`` block's entry to its exit (samplers and probes beside a load)."""

    def __init__(self, interval_s: float, timeout_s: float = 10.0, name: str = "poller") -> None:
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 5)

    def tick(self, http: httpx.Client) -> None:
        """One look (overridden)."""
        raise NotImplementedError

    def _loop(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as http:
            while not self._stop.is_set():
                now = time.monotonic()
                self.tick(http)
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - now)))


class LoadSampler(Poller):
    """A thread that samples the engines' busy slots as ``JobWatch`` does, for a client that is
    not the fleet (a plain client is watched the same way, so both carry the same probes)."""

    def __init__(self, urls: list[str], caps: list[int], interval_s: float) -> None:
        super().__init__(interval_s, name="load-sampler")
        self.urls, self.caps = urls, list(caps)
        self.samples: list[float] = []

    def occupancy(self) -> float:
        """Mean busy-slot fraction from the first busy sample on."""
        first = next((i for i, b in enumerate(self.samples) if b > 0), len(self.samples))
        window = self.samples[first:]
        return sum(window) / len(window) if window else 0.0

    def tick(self, http: httpx.Client) -> None:
        self.samples.append(engine_busy(http, self.urls, self.caps)[0])


class JobWatch:
    """A thread that samples every engine's running slots and the job's batches until done."""

    def __init__(self, urls: list[str], caps: list[int], r: redis.Redis, job: str,
                 n_batches: int, interval_s: float = 0.05) -> None:
        self.urls, self.caps, self.r, self.job = urls, list(caps), r, job
        self.n_batches, self.interval_s = n_batches, interval_s
        self.timeline = Timeline()
        self._http = httpx.Client(timeout=10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="job-watch", daemon=True)

    def __enter__(self) -> JobWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._http.close()

    def wait(self, timeout_s: float, all_taken: bool = False) -> Timeline:
        """Block until every batch is done (or, with ``all_taken``, taken from the queue)."""
        deadline = time.monotonic() + timeout_s
        tl = self.timeline
        while (tl.t_all_taken if all_taken else tl.t_done) is None:
            if not self._thread.is_alive():
                raise RuntimeError(f"the watcher of job {self.job} stopped (see its traceback)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job}: not every batch "
                                   f"{'taken' if all_taken else 'done'} after {timeout_s:.0f} s")
            time.sleep(0.05)
        return tl

    def _busy(self) -> tuple[float, int]:
        return engine_busy(self._http, self.urls, self.caps)

    def _decode_tokens(self) -> float | None:
        """The engines' decode-token counter, or None while one is down (it restarts at 0)."""
        try:
            return decode_tokens(self._http, self.urls)
        except httpx.HTTPError:
            return None

    def _batches(self) -> tuple[int, int]:
        """(batches taken from the queue: owned by a run now or done, batches done)."""
        done = {int(b) for b in self.r.smembers(JobKeys(self.job).done)}
        return len(done | set(live_holders(self.r, self.job))), len(done)

    def _loop(self) -> None:
        tl = self.timeline
        # Read before the job's first request: the engines are idle between two runs of a
        # check, so this is the counter at the job's start if no sample sees a request running.
        decode_at_watch = self._decode_tokens()
        while not self._stop.is_set():
            now = time.monotonic()
            busy, waiting = self._busy()
            tl.samples.append((now, busy, waiting))
            if tl.t_first is None and busy > 0:
                # The counter in the same sample: the window and its tokens start together.
                tl.t_first, tl.decode_at_start = now, self._decode_tokens()
            taken, done = self._batches()
            if tl.t_started is None and taken:
                tl.t_started = now
            if tl.t_all_taken is None and taken >= self.n_batches:
                tl.t_all_taken = time.monotonic()
                tl.decode_at_all_taken = self._decode_tokens()
            if done >= self.n_batches:
                tl.t_done = time.monotonic()
                tl.decode_at_done = self._decode_tokens()
                first, last = self.r.hmget(JobKeys(self.job).job,
                                           ["first_taken_at", "last_row_at"])
                if last:
                    tl.t_last_row = min(tl.t_done, tl.t_done - (time.time() - float(last)))
                if tl.t_first is None and first:
                    # A job quicker than one sample: no sample saw it running, so its window
                    # starts at its own first-taken time, with the counter read before it.
                    tl.t_first = tl.t_done - (time.time() - float(first))
                    tl.decode_at_start = decode_at_watch
                return
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - now)))
