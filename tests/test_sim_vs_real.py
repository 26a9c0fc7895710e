"""The simulator against real SGLang 0.5.11: every captured request, replayed.

Each capture's launch flags (the ``CMD:`` line of its server.log) start a simulator with the
H200's memory; every captured request is sent to it, and the answer must have the real engine's
status code, content type and body shape (the keys, recursively), with the exact error message
wherever the message does not depend on a real tokenizer. One difference is by design and
asserted as such: ``stream: true`` gets a 400 from the simulator where SGLang streams (the fleet
never streams, so the simulator refuses loudly instead of faking it; docs/simulator.md).
"""

from __future__ import annotations

import asyncio
import re
import shlex
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.realfixtures import (
    CAPTURES,
    REAL,
    Exchange,
    exchanges,
    rebuilt_request,
    text,
)
from tests.simproc import Sim, launch
from workers.engine.log import LogFacts, parse_log
from workers.sim.calibration import H200_DUMMY

H200_MIB = 143_771  # nvidia-smi memory.total of the capture's GPU (timing.txt)
MODELS = REAL.parents[2] / "models"
# Answers whose values are the run's own (time, ids, sampled tokens): compared by shape only.
EXACT_MESSAGE = re.compile(r"len\d+_max\d+|bad_temperature|bad_top_p|max_tokens_over_ctx")
# /server_info fields the fleet reads, and what each internal_states entry must carry.
INFO_KEYS = ("max_running_requests", "max_total_num_tokens", "max_mamba_cache_size",
             "max_req_input_len", "decode_log_interval", "context_length", "version",
             "speculative_algorithm", "mamba_scheduler_strategy", "disable_overlap_schedule")
STATE_KEYS = ("effective_max_running_requests_per_dp", "max_mamba_cache_size", "memory_usage",
              "last_gen_throughput")


def launch_argv(capture: str) -> tuple[list[str], dict[str, str]]:
    """The capture's launch flags and environment, the model path pointing at the fixture copy
    of the folder it ran."""
    cmd = text(capture, "server.log").splitlines()[0].removeprefix("CMD: ")
    env_part, _, flags = cmd.partition(" python3 -m sglang.launch_server ")
    env = dict(item.split("=", 1) for item in shlex.split(env_part))
    argv = shlex.split(flags)
    at = argv.index("--model-path") + 1
    folder = Path(argv[at]).name
    argv[at] = str(MODELS / folder)  # the capture's own model folder (its config.json)
    for flag in ("--host", "--port"):
        at = argv.index(flag)
        del argv[at:at + 2]
    return argv, env


# One xdist worker runs this module, so its module fixture starts once (make test).
pytestmark = pytest.mark.xdist_group("sim-replay")


@pytest.fixture(scope="module", params=CAPTURES)
def replay(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Sim]]:
    """A simulator started with one capture's flags on the H200's memory."""
    capture = request.param
    argv, env = launch_argv(capture)
    env |= {"FLEET_SIM_SPEED": "200", "FLEET_SIM_GPU_MEMORY_MIB": str(H200_MIB)}
    sim = launch(tmp_path_factory.mktemp(capture), argv, env)
    sim.wait_ready()
    yield capture, sim
    sim.stop()


def send(sim: Sim, x: Exchange) -> httpx.Response:
    """Send a captured request as it was sent."""
    if x.method == "GET":
        return httpx.get(f"{sim.url}{x.path}", timeout=30.0)
    return httpx.post(f"{sim.url}{x.path}", json=rebuilt_request(x), timeout=60.0)


def shape(value: Any) -> Any:
    """The keys of a JSON value, recursively (lists by their first item, scalars by kind)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if value is None:
        return None
    return "str" if isinstance(value, str) else "number"


def same_shape(real: Any, sim: Any, where: str = "") -> list[str]:
    """Where two JSON values differ in keys. A real null matches anything (random weights
    decode to no text); a simulated null where the real engine answered an object is a
    difference."""
    if real is None:
        return []
    if sim is None:
        nested = isinstance(real, dict | list)
        return [f"{where}: null, real {type(real).__name__}"] if nested else []
    if where.endswith("logprobs.top_logprobs[0]"):
        return []  # /v1/completions: {token text: logprob}, keyed by the sampled tokens
    if isinstance(real, dict) and isinstance(sim, dict):
        out = [f"{where}.{k}: {'missing' if k in real else 'extra'}"
               for k in sorted(set(real) ^ set(sim))]
        for key in set(real) & set(sim):
            out += same_shape(real[key], sim[key], f"{where}.{key}")
        return out
    if isinstance(real, list) and isinstance(sim, list):
        return same_shape(real[0], sim[0], f"{where}[0]") if real and sim else []
    if isinstance(real, dict | list) or isinstance(sim, dict | list):
        return [f"{where}: {type(real).__name__} vs {type(sim).__name__}"]
    return []


def same_counts(x: Exchange, real: Any, mine: Any) -> list[str]:
    """Token counts and finish reasons that must agree (prompt tokens only for token ids: the
    simulator has no tokenizer). Dummy weights never stop early, so every real answer ran to
    its length; the seeded simulator's drawn lengths are longer than these small budgets."""
    out = []
    pairs = list(zip(real, mine, strict=True)) if isinstance(real, list) else [(real, mine)]
    for r, m in pairs:
        if not isinstance(r, dict):
            continue
        if "meta_info" in r:
            r, m = r["meta_info"], m["meta_info"]
            keys = ["completion_tokens", "finish_reason", "reasoning_tokens"]
            if "input_ids" in (x.request or {}) or x.request is None:
                keys.append("prompt_tokens")
        elif "usage" in r:
            r, m = r["usage"], m["usage"]
            keys = ["completion_tokens", "reasoning_tokens"]
        else:
            continue
        out += [f"{k} {m.get(k)!r}, real {r.get(k)!r}" for k in keys if m.get(k) != r.get(k)]
    return out


def _message(body: Any) -> str:
    return body.get("message") or body["error"]["message"]


def _kind(headers: Any) -> str:
    return (headers.get("content-type") or "").split(";")[0]


def test_every_captured_request_gets_the_real_status_and_shape(replay: tuple[str, Sim]) -> None:
    capture, sim = replay
    problems: list[str] = []
    for x in exchanges(capture):
        if x.path in ("/metrics", "/get_server_info", "/server_info"):
            continue  # compared below
        got = send(sim, x)
        if x.streamed:
            assert got.status_code == 400 and "stream" in _message(got.json()), x.name
            continue
        if (got.status_code, _kind(got.headers)) != (x.status, _kind(x.headers)):
            problems.append(f"{x.name}: {got.status_code} {_kind(got.headers)} "
                            f"{got.text[:200]!r}, real {x.status} {_kind(x.headers)}")
            continue
        if x.status == 500 or not x.body:
            if got.text != x.body:
                problems.append(f"{x.name}: body {got.text[:80]!r}, real {x.body!r}")
            continue
        real, mine = x.json(), got.json()
        problems += [f"{x.name}{d}" for d in same_shape(real, mine)]
        problems += [f"{x.name}: {d}" for d in same_counts(x, real, mine)]
        if x.status == 400 and EXACT_MESSAGE.search(x.name) and _message(real) != _message(mine):
            problems.append(f"{x.name}: {_message(mine)!r}, real {_message(real)!r}")
    assert problems == [], "\n".join(problems)


def test_the_context_edge_is_where_sglangs_is(replay: tuple[str, Sim]) -> None:
    capture, sim = replay
    if capture == "dense":
        pytest.skip("the dense capture sent no length probes")
    cases = {x.name: x for x in exchanges(capture) if re.search(r"len\d+_max", x.name)}
    assert len(cases) == 9
    for name, x in cases.items():
        got = send(sim, x)
        assert got.status_code == x.status, (name, got.text)
        if x.status == 400:
            assert got.json() == x.json(), name
    # Between the captured probes: 8186 is refused by the scheduler's check, 8185 is served.
    for n, status in ((8186, 400), (8185, 200)):
        body = {"input_ids": [100 + i % 500 for i in range(n)],
                "sampling_params": {"max_new_tokens": 1}}
        assert httpx.post(f"{sim.url}/generate", json=body, timeout=60).status_code == status


def test_server_info_and_loads_report_the_real_caps(replay: tuple[str, Sim]) -> None:
    capture, sim = replay
    real = next(x for x in exchanges(capture) if x.path == "/server_info").json()
    mine = sim.get("/server_info").json()
    for key in INFO_KEYS:
        if key in ("max_total_num_tokens",):
            continue  # the KV pool: test_the_captured_pools_are_reproduced
        assert mine.get(key) == real.get(key), key
    for key in STATE_KEYS:
        assert (key in mine["internal_states"][0]) == (key in real["internal_states"][0]), key
    # Every field the simulator writes is one SGLang writes (it knows fewer flags, never others).
    infos = [x.json() for x in exchanges(capture) if x.path == "/server_info"]
    assert set(mine) - set().union(*infos) == set()
    states = [i["internal_states"][0] for i in infos]
    assert set(mine["internal_states"][0]) - set().union(*states) == set()
    cap = real["internal_states"][0]["effective_max_running_requests_per_dp"]
    assert mine["internal_states"][0]["effective_max_running_requests_per_dp"] == cap
    assert sim.get("/v1/loads").json()["loads"][0]["max_running_requests"] == cap


def _families(exposition: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Metric families: name -> (type, label keys without ``le``)."""
    types: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            name = re.match(r"[^{ ]+", line).group(0)  # type: ignore[union-attr]
            for suffix in ("_bucket", "_sum", "_count", "_total"):
                if name.endswith(suffix) and name.removesuffix(suffix) in types:
                    name = name.removesuffix(suffix)
            keys = set(re.findall(r'(\w+)="', line)) - {"le"}
            labels.setdefault(name, set()).update(keys)
    # Families with samples only: SGLang's multiprocess collector writes no empty family.
    return {n: (types.get(n, "?"), frozenset(keys)) for n, keys in labels.items()}


READ_BY_THE_FLEET = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
                     "sglang:token_usage", "sglang:num_used_tokens", "sglang:max_total_num_tokens",
                     "sglang:mamba_usage", "sglang:full_token_usage", "sglang:spec_accept_length",
                     "sglang:realtime_tokens_total", "sglang:generation_tokens_total",
                     "sglang:prompt_tokens_total")


# Written on first use (metrics_collector.py, 0.5.11): a prompt-cache hit
# (TokenizerMetricsCollector.observe_one_finished_request) and a retraction
# (SchedulerMetricsCollector.increment_retracted_reqs).
_SCHED = frozenset({"engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank"})
LAZY = {
    "sglang:cached_tokens_total": ("counter", frozenset({"engine_type", "model_name",
                                                         "cache_source"})),
    "sglang:num_retracted_requests_total": ("counter", _SCHED),
}


def test_every_metric_family_of_the_sim_is_sglangs(replay: tuple[str, Sim]) -> None:
    capture, sim = replay
    real_text = next(x for x in exchanges(capture) if x.path == "/metrics").body
    if capture != "dense":
        real_text = text(capture, "load_metrics_t10.txt")
    body = {"text": "word " * 64, "sampling_params": {"max_new_tokens": 50}}
    assert httpx.post(f"{sim.url}/generate", json=body, timeout=60).status_code == 200
    real, mine = _families(real_text), _families(sim.get("/metrics").text)
    real |= LAZY  # families SGLang creates on an event the capture did not see
    differ = {name: (mine[name], real.get(name)) for name in mine if mine[name] != real.get(name)}
    assert differ == {}
    assert set(READ_BY_THE_FLEET) <= set(mine)


def test_the_captured_pools_are_reproduced(replay: tuple[str, Sim]) -> None:
    capture, sim = replay
    real, mine = parse_log(text(capture, "server.log")), parse_log(sim.log())
    assert mine.scheduler is not None and real.scheduler is not None
    assert mine.scheduler.max_running_requests == real.scheduler.max_running_requests
    assert mine.scheduler.context_len == real.scheduler.context_len
    assert mine.mamba == real.mamba  # slots and every Mamba pool's GiB, to the logged digit
    assert mine.kv_tokens == pytest.approx(real.kv_tokens, rel=0.001), "KV tokens"
    graphs = [_graph_sizes(text(capture, "server.log")), _graph_sizes(sim.log())]
    assert graphs[1] == graphs[0]  # the target's CUDA graph batch sizes of the last start


def _graph_sizes(log: str) -> str:
    return re.findall(r"Capture cuda graph bs (\[[0-9, ]*\])", log)[-1]


def _steady_decode_lines() -> list[tuple[float, float, float]]:
    """(running, mean context, measured ms per step) of every decode line that follows a
    decode line of the same batch size (no prefill in its interval)."""
    rows = []
    for capture in CAPTURES[:3]:
        decode = parse_log(text(capture, "server.log")).batches
        for prev, line in zip(decode, decode[1:], strict=False):
            running = line.number("#running-req") or 0
            same = prev.kind == line.kind == "decode" and prev.number("#running-req") == running
            tokens = line.number("#full token") or 0
            rate = line.number("gen throughput (token/s)")
            if same and tokens and rate:
                step = running * (line.number("accept len") or 1.0) / rate * 1000
                rows.append((running, tokens / running, step))
    return rows


def test_the_h200_calibration_fits_every_steady_decode_line() -> None:
    rows = _steady_decode_lines()
    assert len(rows) > 50 and {r for r, _, _ in rows} >= {1, 16, 40}
    for running, context, measured in rows:
        modelled = H200_DUMMY.step_ms(int(running), context, speculative=True)
        assert modelled == pytest.approx(measured, abs=1.0), (running, context)


def _median_rate(facts: LogFacts, running: int, speed: float = 1.0) -> float:
    """Median gen throughput of the decode lines at ``running`` (at real speed)."""
    rates = sorted((b.number("gen throughput (token/s)") or 0) / speed
                   for b in facts.decode_lines() if b.number("#running-req") == running)
    assert rates, running
    return rates[len(rates) // 2]


@pytest.mark.parametrize(("capture", "running"), [("big80", 16), ("big200_40", 40)])
def test_the_h200_simulator_decodes_at_the_real_rate(tmp_path: Path, capture: str,
                                                     running: int) -> None:
    """The capture's load run, replayed on the h200-dummy calibration: the median decode line
    at the cap (prefill intervals included, as in the real log) is the real one, ±15 %. Run at
    5x real time: faster, a loaded 2-core machine makes the simulator lag its own schedule."""
    real = parse_log(text(capture, "server.log"))
    argv, env = launch_argv(capture)
    speed = 5.0
    env |= {"FLEET_SIM_CALIBRATION": "h200-dummy", "FLEET_SIM_SPEED": str(speed)}
    sim = launch(tmp_path, argv, env)
    try:
        sim.wait_ready()
        # The capture's load: 200 prompts at once, 128 new tokens each, ignore_eos.
        bodies = [{"input_ids": [100 + (i + j) % 500 for j in range(250)],
                   "sampling_params": {"max_new_tokens": 128, "ignore_eos": True}}
                  for i in range(200)]
        statuses = asyncio.run(_post_all(f"{sim.url}/generate", bodies))
        assert statuses == [200] * 200
        mine = parse_log(sim.log())
        assert _median_rate(mine, running, speed) == pytest.approx(_median_rate(real, running),
                                                                   rel=0.15)
        at_cap = [b for b in mine.decode_lines() if b.number("#running-req") == running]
        assert {b.fields["cuda graph"] for b in at_cap} == {True}
        # 4 slots per request, as in the capture. Under the overlap scheduler a decode batch
        # can still carry requests that finished the step before (SGLang logs len(batch.reqs)
        # after their slots were freed), so such a line shows fewer: never more.
        mamba = Counter(b.number("mamba num") for b in at_cap)
        assert mamba.most_common(1)[0][0] == 4 * running and max(mamba) == 4 * running, mamba
        _same_line_formats(real, mine)
        loads = sim.get("/v1/loads").json()["loads"][0]
        assert loads["max_running_requests"] == running
    finally:
        sim.stop()


def _same_line_formats(real: LogFacts, mine: LogFacts) -> None:
    """The simulator's Decode/Prefill batch lines carry SGLang's fields in SGLang's order."""
    for kind in ("decode", "prefill"):
        want = {tuple(b.fields) for b in real.batches if b.kind == kind}
        got = {tuple(b.fields) for b in mine.batches if b.kind == kind}
        assert got and got <= want, (kind, got - want)


async def _post_all(url: str, bodies: list[dict[str, Any]]) -> list[int]:
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        answers = await asyncio.gather(*(client.post(url, json=b) for b in bodies))
    return [a.status_code for a in answers]


def test_short_prompts_hold_three_mamba_slots_as_in_the_capture(tmp_path: Path) -> None:
    """The capture's 43-token prompts held 3 slots each ("#running-req: 2, ..., mamba num: 6"):
    a prompt under mamba_cache_chunk_size (64) forks no state into the radix tree."""
    real = [b for b in parse_log(text("big80", "server.log")).decode_lines()
            if b.number("#running-req") == 2 and b.number("#full token")]
    assert {b.number("mamba num") for b in real} == {6}
    argv, env = launch_argv("big80")
    env |= {"FLEET_SIM_SPEED": "5", "FLEET_SIM_CALIBRATION": "h200-dummy"}
    sim = launch(tmp_path, argv, env)
    try:
        sim.wait_ready()
        bodies = [{"input_ids": [100 + i + j for j in range(43)],
                   "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
                  for i in range(2)]
        assert asyncio.run(_post_all(f"{sim.url}/generate", bodies)) == [200, 200]
        lines = [b for b in parse_log(sim.log()).decode_lines() if b.number("#running-req") == 2]
        assert lines and {b.number("mamba num") for b in lines} == {6}
    finally:
        sim.stop()
