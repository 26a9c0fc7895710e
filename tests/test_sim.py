"""End-to-end tests of the engine simulator, run as a real subprocess on a free local port."""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from config.launch_profile import load_profile
from producer.localfleet import free_port
from tests.simproc import ROOT, Sim, launch
from workers.sim.report import MIN_LOG_INTERVAL_S

SMALL_MODEL = ["--model-path", "Qwen/Qwen3-0.6B", "--context-length", "4096"]


@pytest.fixture
def start(tmp_path: Path) -> Iterator:
    """Factory fixture: start sims that are stopped at teardown."""
    sims: list[Sim] = []

    def _start(argv: list[str], env: dict[str, str] | None = None, ready: bool = True) -> Sim:
        sim = launch(tmp_path, argv, env)
        sims.append(sim)
        if ready:
            sim.wait_ready()
        return sim

    yield _start
    for sim in sims:
        sim.stop()


# One xdist worker runs this module, so its module fixture starts once (make test).
pytestmark = pytest.mark.xdist_group("sim-small")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """One fast dense-model sim shared by the API-shape tests."""
    env = {"FLEET_SIM_SPEED": "1000", "FLEET_SIM_MEAN_OUTPUT_TOKENS": "40"}
    argv = [*SMALL_MODEL, "--enable-metrics", "--reasoning-parser", "qwen3"]
    sim = launch(tmp_path_factory.mktemp("small"), argv, env)
    sim.wait_ready()
    yield sim
    sim.stop()


def profile_argv(name: str) -> tuple[list[str], dict[str, str]]:
    """argv and env of a launch profile from config/profiles."""
    profile = load_profile(name)
    return profile.to_argv(), dict(profile.env)


async def _post_many(url: str, bodies: list[dict]) -> list[httpx.Response]:
    """POST every body to ``url`` concurrently."""
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        return list(await asyncio.gather(*(client.post(url, json=b) for b in bodies)))


# --- capacity as the engine reports it ------------------------------------------------------


def test_baseline_profile_reports_cap_16_but_cli_48(start) -> None:
    argv, env = profile_argv("qwen36-27b-baseline")
    sim = start(argv, env)
    info = sim.get("/server_info").json()
    assert info["max_running_requests"] == 48  # the CLI value SGLang shows at the top level
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 16
    assert info["internal_states"][0]["max_mamba_cache_size"] == 80
    # SGLang's arithmetic from the config on the sim's B200 (the seed's "~1.14 M" is not reproduced)
    assert info["max_total_num_tokens"] == pytest.approx(1_553_019, rel=0.001)
    assert info["status"] == "ready"
    loads = sim.get("/v1/loads").json()
    assert loads["loads"][0]["max_running_requests"] == 16
    assert sim.get("/get_server_info").json()["max_running_requests"] == 48


def test_startup_log_has_sglang_lines(start) -> None:
    argv, env = profile_argv("qwen36-27b-baseline")
    log = start(argv, env).log()
    stamp = r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] "
    sched = re.search(
        stamp + r"max_total_num_tokens=(\d+), chunked_prefill_size=16384, "
        r"max_prefill_tokens=16384, max_running_requests=16, context_len=8192, "
        r"available_gpu_mem=\d+\.\d\d GB$",
        log,
        re.M,
    )
    assert sched, log
    assert re.search(stamp + r"Max running requests is reset to 48 for speculative", log, re.M)
    assert re.search(
        r"Mamba Cache is allocated\. max_mamba_cache_size: 80, conv_state size: 0\.22GB, "
        r"ssm_state size: 11\.39GB intermediate_ssm_state_cache size: 9\.56GB "
        r"intermediate_conv_window_cache size: 0\.19GB ",
        log,
    )
    assert re.search(r"KV Cache is allocated\. #tokens: \d+, K size: \d+\.\d\d GB, V size:", log)
    order = ["Load weight begin", "Load weight end", "Memory pool end", "Capture cuda graph end"]
    positions = [log.index(marker) for marker in order]
    assert positions == sorted(positions)
    assert log.index("Capture cuda graph end") < sched.start()


def test_tuned_profile_runs_40(start) -> None:
    argv, env = profile_argv("qwen36-27b")
    sim = start(argv, env)
    assert sim.get("/v1/loads").json()["loads"][0]["max_running_requests"] == 40
    assert sim.get("/server_info").json()["max_running_requests"] == 40


RUNNING_16 = re.compile(r"^sglang:num_running_reqs\{[^}]*\} 16\.0$", re.M)


def test_cap_is_enforced_and_the_rest_waits(start) -> None:
    argv, env = profile_argv("qwen36-27b-baseline")
    # 200 tokens at accept 3.5 -> ~57 steps of 28 ms = 1.6 s at speed 1; speed 2 -> 0.8 s.
    sim = start(argv, {**env, "FLEET_SIM_SPEED": "2", "FLEET_SIM_MEAN_OUTPUT_TOKENS": "100000"})
    bodies = [
        {"text": f"prompt {i}", "sampling_params": {"max_new_tokens": 200}} for i in range(24)
    ]

    async def scenario() -> tuple[dict, str, list[httpx.Response]]:
        task = asyncio.create_task(_post_many(f"{sim.url}/generate", bodies))
        await asyncio.sleep(0.35)
        async with httpx.AsyncClient(timeout=10.0) as client:
            loads = (await client.get(f"{sim.url}/v1/loads")).json()
            # Gauges are written per admission round and decode-log interval, as in SGLang, so
            # /metrics may lag /v1/loads by up to one interval: read it until it catches up.
            for _ in range(30):
                metrics = (await client.get(f"{sim.url}/metrics")).text
                if RUNNING_16.search(metrics):
                    break
                await asyncio.sleep(0.05)
        return loads, metrics, await task

    loads, metrics, responses = asyncio.run(scenario())
    entry = loads["loads"][0]
    assert entry["num_running_reqs"] == 16
    assert entry["num_waiting_reqs"] == 8
    assert entry["queues"]["waiting"] == 8
    assert RUNNING_16.search(metrics)
    assert all(r.status_code == 200 for r in responses)
    finishes = [r.json()["meta_info"]["finish_reason"] for r in responses]
    assert finishes == [{"type": "length", "length": 200}] * 24
    latencies = sorted(r.json()["meta_info"]["e2e_latency"] for r in responses)
    assert latencies[-1] > 1.6 * latencies[0]  # the last 8 waited for a free slot


def test_step_time_follows_the_measured_model(start) -> None:
    argv, env = profile_argv("qwen36-27b")
    sim = start(argv, {**env, "FLEET_SIM_SPEED": "1", "FLEET_SIM_MEAN_OUTPUT_TOKENS": "100000"})
    meta = sim.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 71}}).json()
    meta = meta["meta_info"]
    # 1 prefill token + 20 decode steps of 3.5 tokens; each step 20 + 0.5 * 1 ms -> ~0.41 s.
    assert meta["spec_verify_ct"] == 20
    assert meta["completion_tokens"] == 71
    assert 0.35 < meta["e2e_latency"] < 0.9
    assert meta["spec_accept_length"] == pytest.approx(71 / 20)


# --- request handling -----------------------------------------------------------------------


def test_finish_reason_length_and_stop(small: Sim) -> None:
    resp = small.post("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 5}})
    assert resp.status_code == 200
    body = resp.json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert body["meta_info"]["completion_tokens"] == 5
    assert len(body["output_ids"]) == 5
    assert len(body["text"].split()) == 5
    assert body["meta_info"]["prompt_tokens"] == 2  # ceil(5 chars / 4)
    stops = [
        small.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 3000}}).json()
        for _ in range(5)
    ]
    for item in stops:  # mean output 40 tokens: every one stops on EOS long before 3000
        meta = item["meta_info"]
        assert meta["finish_reason"] == {"type": "stop", "matched": 151645}
        assert item["output_ids"][-1] == 151645
        assert len(item["output_ids"]) == meta["completion_tokens"] < 3000


def test_batch_generate_returns_a_list(small: Sim) -> None:
    body = {"text": ["a", "bb"], "sampling_params": {"max_new_tokens": 2}, "rid": ["r1", "r2"]}
    items = small.post("/generate", body).json()
    assert [i["meta_info"]["id"] for i in items] == ["r1", "r2"]


def test_too_long_input_is_rejected(small: Sim) -> None:
    resp = small.post("/generate", {"text": "abcd" * 4200})
    assert resp.status_code == 400
    assert "longer than the model's context length (4096 tokens)" in resp.json()["error"]["message"]
    resp = small.post(
        "/generate", {"text": "abcd" * 4000, "sampling_params": {"max_new_tokens": 200}}
    )
    assert resp.status_code == 400
    assert "maximum context length of 4096 tokens" in resp.json()["error"]["message"]
    chat = small.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 20000}]}
    )
    assert chat.status_code == 400
    assert chat.json()["object"] == "error"


def test_bad_sampling_params_are_rejected(small: Sim) -> None:
    for params in ({"max_new_tokens": -1}, {"temperature": -0.5}, {"top_p": 0}):
        resp = small.post("/generate", {"text": "hi", "sampling_params": params})
        assert resp.status_code == 400, params
    assert small.post("/generate", {"sampling_params": {}}).status_code == 400


def test_unknown_sampling_key_is_a_bare_500_as_in_sglang(small: Sim) -> None:
    # SamplingParams(**params) raises TypeError and /generate catches only ValueError.
    for key in ("seed", "user", "logprobs", "best_of", "max_completion_tokens"):
        resp = small.post("/generate", {"text": "hi", "sampling_params": {key: 1}})
        assert resp.status_code == 500, key
        assert resp.text == "Internal Server Error"
        assert resp.headers["content-type"].startswith("text/plain")
    known = {"sampling_seed": 1, "n": 1, "max_new_tokens": 2, "spaces_between_special_tokens": True}
    assert small.post("/generate", {"text": "hi", "sampling_params": known}).status_code == 200
    # The OpenAI routes parse the body into pydantic models: unknown keys never reach
    # SamplingParams.
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 1,
            "user": "u", "logprobs": False}
    assert small.post("/v1/chat/completions", body).status_code == 200
    assert small.get("/health").status_code == 200


def test_logprobs_come_in_sglangs_shapes_and_badly_typed_fields_are_refused(small: Sim) -> None:
    # /generate: TokenizerManager.add_logprob_to_meta_info, one (logprob, id, text) per output
    # token; top_logprobs_num > 0 adds the input and output top lists.
    got = small.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 5},
                                   "return_logprob": True, "top_logprobs_num": 2}).json()
    meta = got["meta_info"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert [x[1] for x in meta["output_token_logprobs"]] == got["output_ids"]
    assert meta["input_top_logprobs"] == [] and {len(t) for t in meta["output_top_logprobs"]} == {2}
    plain = small.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 5},
                                     "top_logprobs_num": 2}).json()["meta_info"]
    assert not any(k.endswith("logprobs") for k in plain)  # return_logprob not set
    # Chat: ChoiceLogprobs over every generated token (the stop token too).
    msgs = [{"role": "user", "content": "hi"}]
    chat = small.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 5,
                                               "logprobs": True, "top_logprobs": 1}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert set(content[0]) == {"token", "bytes", "logprob", "top_logprobs"}
    assert len(content[0]["top_logprobs"]) == 1
    # ChatCompletionRequest declares logprobs: bool and top_logprobs: Optional[int].
    for bad in ({"logprobs": 3}, {"logprobs": "yes"}, {"logprobs": True, "top_logprobs": 1.5}):
        resp = small.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2, **bad})
        assert resp.status_code == 400, bad


def test_output_length_is_drawn_from_the_seed_and_the_prompt(small: Sim, start) -> None:
    other = start([*SMALL_MODEL], {"FLEET_SIM_SPEED": "1000", "FLEET_SIM_MEAN_OUTPUT_TOKENS": "40"})
    prompts = [f"prompt number {i}" for i in range(12)]

    def lengths(sim: Sim, order: list[str]) -> dict[str, int]:
        bodies = [{"text": p, "sampling_params": {"max_new_tokens": 3000}} for p in order]
        got = asyncio.run(_post_many(f"{sim.url}/generate", bodies))
        pairs = zip(order, got, strict=True)
        return {p: r.json()["meta_info"]["completion_tokens"] for p, r in pairs}

    first = lengths(small, prompts)
    assert len(set(first.values())) > 1  # a distribution, not one length
    assert lengths(other, prompts[::-1]) == first  # another process, another order


def test_openai_endpoints(small: Sim) -> None:
    comp = small.post("/v1/completions", {"prompt": "hello there", "model": "x"}).json()
    assert comp["object"] == "text_completion"
    assert comp["usage"]["completion_tokens"] <= 16  # OpenAI default max_tokens
    msgs = [{"role": "user", "content": "why?"}]
    chat = small.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 4000}).json()
    message = chat["choices"][0]["message"]
    assert message["reasoning_content"]
    assert chat["usage"]["reasoning_tokens"] > 0
    assert chat["usage"]["reasoning_tokens"] <= chat["usage"]["completion_tokens"]
    off = {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}
    plain = small.post("/v1/chat/completions", off).json()
    assert plain["choices"][0]["message"]["reasoning_content"] is None
    assert plain["usage"]["reasoning_tokens"] == 0
    assert small.get("/v1/models").json()["data"][0]["id"] == "Qwen/Qwen3-0.6B"
    assert small.get("/model_info").json()["is_generation"] is True


def test_metrics_use_sglang_colon_names(small: Sim) -> None:
    before = small.get("/metrics").text
    done = re.search(r"^sglang:num_requests_total\{[^}]*\} (\S+)$", before, re.M)
    assert done
    small.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    text = small.get("/metrics").text
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "gen_throughput"):
        assert re.search(rf'^sglang:{name}\{{.*engine_type="unified".*\}} ', text, re.M), name
    assert 'sglang:realtime_tokens_total{engine_type="unified",mode="decode"' in text
    after = re.search(r"^sglang:num_requests_total\{[^}]*\} (\S+)$", text, re.M)
    assert after and float(after.group(1)) >= float(done.group(1)) + 1
    assert "sglang:e2e_request_latency_seconds_bucket" in text


def test_metrics_404_without_enable_metrics(start) -> None:
    sim = start(SMALL_MODEL, {"FLEET_SIM_SPEED": "1000"})
    assert sim.get("/metrics").status_code == 404


def test_connections_are_refused_while_loading_then_health_is_503_in_the_warmup(start) -> None:
    # SGLang starts its HTTP server only once the model and pools are ready, then warms up
    # with /health answering 503 (ServerStatus.Starting) until it is fired up.
    sim = start(SMALL_MODEL, {"FLEET_SIM_STARTUP_S": "3"}, ready=False)
    deadline, codes, refused = time.monotonic() + 60, [], 0
    while time.monotonic() < deadline and 200 not in codes:
        try:
            codes.append(sim.get("/health").status_code)
        except httpx.ConnectError:
            refused += 1
        time.sleep(0.1)
    assert refused > 0 and codes[-1] == 200 and 503 in codes
    assert codes == sorted(codes, reverse=True)  # 503 while warming up, then only 200
    log = sim.log()
    assert log.index("max_total_num_tokens=") < log.index("The server is fired up")


def test_length_check_counts_speculative_reserved_tokens(start) -> None:
    argv, env = profile_argv("qwen36-27b-baseline")  # NEXTN: max(topk*steps, draft) = 4
    sim = start(argv, {**env, "FLEET_SIM_SPEED": "1000"})
    context = sim.get("/server_info").json()["context_length"]
    ids = [1] * (context - 200)

    def status(max_new: int) -> int:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}}
        return sim.post("/generate", body).status_code

    assert status(196) == 200  # input + 4 reserved + 196 == context: allowed (not >)
    assert status(197) == 400


def _too_long(context: int, counted: int) -> str:
    return (f"The input ({counted} tokens) is longer than the model's context length "
            f"({context} tokens).")


@pytest.mark.parametrize("spec", [False, True])
def test_every_length_limit_at_both_endpoints(start, spec: bool) -> None:
    """SGLang 0.5.11's three limits, in its order, at /generate and chat, with and without MTP:
    the tokenizer's (input + reserved >= context; + max_new_tokens > context), the scheduler's
    (input >= min(context - 1, pool - 1) - 5) and chat's max_completion_tokens > --context-length.
    """
    if spec:
        argv, env = profile_argv("qwen36-27b-baseline")  # NEXTN 3/1/4: 4 reserved
    else:
        argv, env = ["--model-path", "Qwen/Qwen3-0.6B", "--context-length", "8192"], {}
    sim = start(argv, {**env, "FLEET_SIM_SPEED": "1000"})
    info = sim.get("/server_info").json()
    context, limit = info["context_length"], info["max_req_input_len"]
    reserved = 4 if spec else 0
    assert (context, limit) == (8192, 8186)

    def generate(n: int, max_new: int | None = 1) -> httpx.Response:
        return sim.post("/generate", {"input_ids": [7] * n,
                                      "sampling_params": {"max_new_tokens": max_new}})

    for n in (context - reserved, context + 100):  # the tokenizer's check
        got = generate(n)
        assert got.status_code == 400
        assert got.json() == {"error": {"message": _too_long(context, n + reserved)}}
    for n in range(limit, context - reserved):  # then the scheduler's
        got = generate(n)
        assert got.status_code == 400, n
        assert got.json()["error"]["message"] == (
            f"Input length ({n} tokens) exceeds the maximum allowed length ({limit} tokens). "
            "Use a shorter input or enable --allow-auto-truncate.")
    assert generate(limit - 1).status_code == 200
    assert generate(limit - 1, None).status_code == 200  # null: up to the context
    over = generate(100, context - 100 - reserved + 1)
    assert over.status_code == 400 and over.json()["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 8192 tokens. "
        f"You requested a total of {context + 1} tokens: {100 + reserved} tokens")
    assert generate(100, context - 100 - reserved).status_code == 200

    def chat(content: str, max_tokens: int | None) -> httpx.Response:
        body: dict = {"messages": [{"role": "user", "content": content}]}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        return sim.post("/v1/chat/completions", body)

    big = chat("hi", context + 1)
    assert big.status_code == 400 and big.json() == {
        "object": "error", "type": "BadRequestError", "param": None, "code": 400,
        "message": f"max_completion_tokens is too large: {context + 1}.This model supports at "
                   f"most {context} completion tokens."}
    total = chat("hi", context)  # not too large, but prompt + reserved + 8192 > the context
    assert total.status_code == 400
    assert total.json()["message"].startswith("Requested token count exceeds")
    long_text = "abcd" * (context + 50)  # ceil(chars / 4) prompt tokens > the context
    assert chat(long_text, None).json()["message"].endswith(
        f"is longer than the model's context length ({context} tokens).")
    assert chat("hi", None).status_code == 200
    assert chat("hi", 16).status_code == 200


def test_extra_buffer_without_radix_cache_fails_at_start() -> None:
    argv = ["--model-path", "Qwen/Qwen3.6-27B", "--mamba-scheduler-strategy", "extra_buffer",
            "--disable-radix-cache"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "workers.sim", *argv, "--port", str(free_port())],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "requires the radix cache" in res.stdout + res.stderr


def test_int_flags_refuse_human_readable_values_where_sglang_does() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for flag, ok in (("--chunked-prefill-size", False), ("--max-total-tokens", True)):
        argv = [*SMALL_MODEL, flag, "32k", "--port", str(free_port())]
        proc = subprocess.Popen([sys.executable, "-m", "workers.sim", *argv], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            code = proc.wait(timeout=10)  # a loaded 2-core machine starts Python slowly
        except subprocess.TimeoutExpired:
            code = None  # still starting: argparse took the value
        finally:
            proc.kill()
            proc.wait()
        assert (code is None) == ok, flag
        if not ok:
            assert code == 2


# --- failures -------------------------------------------------------------------------------


def test_unknown_flag_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "workers.sim", *SMALL_MODEL, "--no-such-flag", "1"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert b"unrecognized arguments: --no-such-flag" in proc.stderr


def test_invalid_hybrid_config_fails_at_start_like_sglang() -> None:
    argv = ["--model-path", "Qwen/Qwen3.6-27B", "--speculative-algorithm", "NEXTN"]
    proc = subprocess.run(
        [sys.executable, "-m", "workers.sim", *argv, "--port", str(free_port())],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert b"ValueError" in proc.stdout and b"extra_buffer" in proc.stdout


def test_crash_marker_kills_the_process(start) -> None:
    sim = start(SMALL_MODEL, {"FLEET_SIM_SPEED": "1000"})
    with pytest.raises(httpx.HTTPError):
        sim.post("/generate", {"text": "poison __SIM_CRASH__ prompt"})
    assert sim.proc.wait(timeout=5) == 1
    assert "__SIM_CRASH__" in sim.log()


def test_hang_marker_holds_a_slot_until_aborted(start) -> None:
    sim = start(SMALL_MODEL, {"FLEET_SIM_SPEED": "1000"})

    async def scenario() -> tuple[dict, dict]:
        async with httpx.AsyncClient(base_url=sim.url, timeout=30.0) as client:
            body = {"text": "__SIM_HANG__", "rid": "stuck"}
            hung = asyncio.create_task(client.post("/generate", json=body))
            await asyncio.sleep(0.5)
            loads = (await client.get("/v1/loads")).json()
            ok = await client.post(
                "/generate", json={"text": "fine", "sampling_params": {"max_new_tokens": 2}}
            )
            assert ok.status_code == 200  # the engine keeps serving other requests
            await client.post("/abort_request", json={"rid": "stuck"})
            return loads, (await hung).json()

    loads, hung = asyncio.run(scenario())
    assert loads["loads"][0]["num_running_reqs"] == 1
    assert hung["meta_info"]["finish_reason"]["type"] == "abort"
    assert hung["meta_info"]["completion_tokens"] == 0


def test_sigterm_exits_within_a_second(start) -> None:
    sim = start(SMALL_MODEL, {"FLEET_SIM_SPEED": "0.01"})
    with httpx.Client(timeout=1.0) as client:
        with pytest.raises(httpx.TimeoutException):
            client.post(f"{sim.url}/generate", json={"text": "slow"})  # still running
    begin = time.monotonic()
    sim.proc.send_signal(signal.SIGTERM)
    sim.proc.wait(timeout=5)
    assert time.monotonic() - begin < 2.0  # the sim's own deadline is 0.8 s; slack for a busy box
    assert sim.proc.returncode == 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_server_cost_per_request_is_small(start) -> None:
    # Measured as the sim's own CPU time, so other load on the box skews it less. Outputs of
    # 4,000 tokens expose per-token work: even 1 us per token would blow the 4 ms budget.
    argv, env = profile_argv("qwen36-27b")
    sim = start(argv, {**env, "FLEET_SIM_SPEED": "1000000"})
    params = {"max_new_tokens": 4000, "ignore_eos": True}
    bodies = [{"text": f"q{i}", "sampling_params": params} for i in range(100)]
    before = cpu_seconds(sim.proc.pid)
    responses = asyncio.run(_post_many(f"{sim.url}/generate", bodies))
    per_request = (cpu_seconds(sim.proc.pid) - before) / len(bodies)
    assert all(r.status_code == 200 for r in responses)
    metas = [r.json()["meta_info"] for r in responses]
    assert {m["completion_tokens"] for m in metas} == {4000}
    # Several steps may run in one pass at this speed, but never past a finish: the step count
    # is exactly that of 1 prefill token plus 3.5 tokens per verify step.
    assert {m["spec_verify_ct"] for m in metas} == {math.ceil(3999 / 3.5)}
    assert per_request < 4e-3


def test_shared_prefix_hits_the_radix_cache_unless_it_is_disabled(start) -> None:
    system = "You are a careful assistant. " * 40  # ~300 tokens shared by every prompt
    bodies = [{"text": f"{system}question {i}", "sampling_params": {"max_new_tokens": 2}}
              for i in range(6)]
    env = {"FLEET_SIM_SPEED": "1000"}
    for argv, hits in (([*SMALL_MODEL, "--enable-metrics"], True),
                       ([*SMALL_MODEL, "--enable-metrics", "--disable-radix-cache"], False)):
        sim = start(argv, env)
        cached = []
        for body in bodies:
            # Faster than real time the sim writes at most one prefill line per interval: space
            # the requests so each admission logs its line, as SGLang does every prefill.
            time.sleep(MIN_LOG_INTERVAL_S * 1.5)
            cached.append(sim.post("/generate", body).json()["meta_info"]["cached_tokens"])
        assert cached[0] == 0
        assert (min(cached[1:]) > 0) == hits and (max(cached) == 0) == (not hits)
        # Counters and the prefill log line are written per scheduler interval, as in SGLang:
        # read until they catch up (a loaded machine delays the interval).
        deadline = time.monotonic() + 10
        while True:
            metrics = sim.get("/metrics").text
            found = re.search(
                r'^sglang:cached_tokens_total\{[^}]*cache_source="device"[^}]*\} (\S+)$',
                metrics, re.M)
            logged = not hits or re.search(r"#cached-token: [1-9]", sim.log())
            if not hits or (found is not None and float(found.group(1)) == sum(cached)
                            and logged) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if hits:
            assert found is not None and float(found.group(1)) == sum(cached)
        else:  # SGLang writes the labelled counter on the first hit: none, no sample
            assert found is None
        assert logged


def test_admission_is_optimistic_and_a_full_pool_retracts(start) -> None:
    # 8 requests of ~100 + 1000 tokens on a 3000-token pool: budgeting every output in full
    # would run 2 at a time; SGLang budgets output x new_token_ratio and retracts when short.
    sim = start([*SMALL_MODEL, "--max-total-tokens", "3000"], {"FLEET_SIM_SPEED": "200"})
    params = {"max_new_tokens": 1000, "ignore_eos": True}
    bodies = [{"text": f"{i:03d} " + "x" * 396, "sampling_params": params} for i in range(8)]
    done = asyncio.run(_post_many(f"{sim.url}/generate", bodies))
    metas = [r.json()["meta_info"] for r in done]
    assert all(m["completion_tokens"] == 1000 for m in metas)
    assert max(m["total_retractions"] for m in metas) > 0
    log = sim.log()
    # Only a batch admitted beyond what the pool holds at full length can run short.
    assert "KV cache pool is full. Retract requests. #retracted_reqs: " in log


def test_input_ids_that_are_not_token_ids_are_a_400(start) -> None:
    # Real SGLang 0.5.11 answered 400 to input_ids given as strings (a tokenizer's
    # BatchEncoding listed as its keys), H200, 2026-12-03.
    argv, env = profile_argv("qwen36-27b")
    sim = start(argv, {**env, "FLEET_SIM_SPEED": "1000"})
    bad = sim.post("/generate", {"input_ids": ["input_ids", "attention_mask"],
                                 "sampling_params": {"max_new_tokens": 4}})
    assert bad.status_code == 400
    assert sim.post("/generate", {"input_ids": [11, 12, 13],
                                  "sampling_params": {"max_new_tokens": 4}}).status_code == 200
