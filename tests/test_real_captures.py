"""The fleet's own readers on real SGLang 0.5.11 output (one H200, tests/fixtures/.../real-h200).

Each capture is parsed by the code that reads a live engine: the start-up and scheduler lines by
:mod:`workers.engine.log`, ``/metrics`` by :mod:`workers.engine.metrics`, ``/server_info`` and
``/v1/loads`` by :mod:`workers.engine.versions` and :func:`workers.engine.client.effective_cap`,
and every generation answer by :class:`workers.engine.client.EngineClient` itself, talking to a
local server that replays the captured status, content type and body byte for byte.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from aiohttp import web

from producer.localfleet import free_port
from tests.realfixtures import CAPTURES, HYBRID, Exchange, exchange, exchanges, samples, text
from workers.engine.client import EngineClient, Sampling, effective_cap, parse_generate
from workers.engine.log import parse_log
from workers.engine.metrics import full_kv_usage, parse_metrics
from workers.engine.versions import check_version, engine_version
from workers.errors import PromptFailed, PromptRejected
from workers.observe.gauges import sample_from

# What each start logged (the pool lines, verbatim in the capture README and server.log).
STARTS = {
    "big80": dict(cap=16, kv=755_549, slots=80, ssm=11.39, conv=0.22, issm=9.56, iconv=0.19,
                  reset=48, kv_gib=23.06),
    "big200": dict(cap=40, kv=429_581, slots=200, ssm=28.27, conv=0.55, issm=23.06, iconv=0.45,
                   reset=None, kv_gib=13.10),
    "big200_40": dict(cap=40, kv=880_589, slots=200, ssm=28.27, conv=0.55, issm=23.06,
                      iconv=0.45, reset=None, kv_gib=26.88),
    "dense": dict(cap=4096, kv=132_266_620, slots=None, reset=None, kv_gib=126.14),
}
CLI_CAP = {"big80": 48, "big200": 64, "big200_40": 40, "dense": None}
DECODE_KEYS = {"#running-req", "#full token", "full token usage", "mamba num", "mamba usage",
               "accept len", "accept rate", "cuda graph", "gen throughput (token/s)",
               "#queue-req"}
PREFILL_KEYS = {"#new-seq", "#new-token", "#cached-token", "full token usage", "mamba usage",
                "#running-req", "#queue-req", "#pending-token", "cuda graph",
                "input throughput (token/s)"}


# --- start-up and scheduler lines (workers/engine/log.py) ------------------------------------


@pytest.mark.parametrize("capture", CAPTURES)
def test_startup_log_reads_every_pool_and_the_cap(capture: str) -> None:
    facts, want = parse_log(text(capture, "server.log")), STARTS[capture]
    assert facts.unread == []
    assert facts.scheduler is not None
    assert facts.scheduler.max_running_requests == want["cap"]
    assert facts.scheduler.max_total_num_tokens == want["kv"] == facts.kv_tokens
    assert facts.scheduler.context_len == 8192
    assert facts.scheduler.chunked_prefill_size == 8192
    assert facts.kv_gib == pytest.approx(want["kv_gib"], abs=0.011)
    assert facts.weights_begin_avail_gib == pytest.approx(139.13)
    assert facts.spec_reset_to == want["reset"]
    assert facts.server_args["decode_log_interval"] == 40
    assert facts.server_args["max_running_requests"] == CLI_CAP[capture]
    if want["slots"] is None:
        assert facts.mamba is None and facts.draft_weights_gib is None
        return
    assert facts.weights_gib == pytest.approx(50.89)
    assert facts.draft_weights_gib == pytest.approx(5.52)  # the draft model, not the target's
    mamba = facts.mamba
    assert mamba is not None and mamba.slots == want["slots"]
    got = (mamba.ssm_gib, mamba.conv_gib, mamba.intermediate_ssm_gib, mamba.intermediate_conv_gib)
    assert got == (want["ssm"], want["conv"], want["issm"], want["iconv"])


@pytest.mark.parametrize("capture", CAPTURES)
def test_every_scheduler_line_is_read_with_its_fields(capture: str) -> None:
    log = text(capture, "server.log")
    facts = parse_log(log)
    assert len(facts.batches) == log.count("Decode batch") + log.count("Prefill batch") > 0
    hybrid = capture in HYBRID
    for batch in facts.batches:
        keys = set(batch.fields)
        if batch.kind == "decode":
            assert keys == DECODE_KEYS if hybrid else {"#running-req", "#token", "token usage",
                                                       "cuda graph", "gen throughput (token/s)",
                                                       "#queue-req"} <= keys
            assert batch.number("gen throughput (token/s)") is not None
            assert isinstance(batch.fields["cuda graph"], bool)
        else:
            assert keys == PREFILL_KEYS if hybrid else "#new-token" in keys
        assert batch.timestamp is not None


@pytest.mark.parametrize("capture", HYBRID)
def test_decode_lines_show_the_cap_and_four_slots_per_running_request(capture: str) -> None:
    decode = parse_log(text(capture, "server.log")).decode_lines()
    running = [b.number("#running-req") for b in decode]
    assert max(running) == STARTS[capture]["cap"]
    at_cap = [b for b in decode if b.number("#running-req") == STARTS[capture]["cap"]]
    # Overlap scheduling logs the batch that just finished now and then (#full token: 0,
    # mamba num: 0); every other line at the cap holds 4 slots per request (the cap divides by 5).
    slots = [b.number("mamba num") for b in at_cap if b.number("#full token")]
    assert len(slots) >= 0.9 * len(at_cap) and set(slots) == {4 * STARTS[capture]["cap"]}
    assert {b.number("accept len") for b in at_cap} == {1.0}  # dummy weights: MTP accepts ~1


# --- /metrics (workers/engine/metrics.py) ----------------------------------------------------


def _metric_texts(capture: str) -> list[str]:
    found = [x.body for x in exchanges(capture) if x.path == "/metrics"]
    if capture in HYBRID:
        found += [text(capture, "load_metrics_t2.txt"), text(capture, "load_metrics_t10.txt")]
    return found


@pytest.mark.parametrize("capture", CAPTURES)
def test_metrics_are_read_under_sglangs_colon_names(capture: str) -> None:
    for body in _metric_texts(capture):
        metrics = parse_metrics(body)
        assert metrics.total("max_total_num_tokens") == STARTS[capture]["kv"]
        assert metrics.source("num_running_reqs") == "sglang:num_running_reqs"
        assert metrics.total("num_running_reqs") is not None
        usage, source = full_kv_usage(metrics)
        assert usage is not None and 0.0 <= usage < 0.05 and "num_used_tokens" in source


@pytest.mark.parametrize("capture", HYBRID)
def test_metrics_under_load_show_the_cap_and_the_queue(capture: str) -> None:
    metrics = parse_metrics(text(capture, "load_metrics_t10.txt"))
    assert metrics.total("num_running_reqs") == STARTS[capture]["cap"]
    assert (metrics.total("num_queue_reqs") or 0) > 100
    # token_usage is max(full, mamba): the Mamba pool, never the KV pool, on a hybrid model.
    assert metrics.mean("token_usage") == pytest.approx(0.8, abs=0.05)
    usage, _ = full_kv_usage(metrics)
    assert usage is not None and usage < 0.05
    assert metrics.mean("spec_accept_length") == pytest.approx(1.0, abs=0.05)


# --- /server_info and /v1/loads (workers/engine/versions.py, client.effective_cap) -----------


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("when", ["before", "after"])
def test_effective_cap_and_version_come_from_loads_and_internal_states(
    capture: str, when: str
) -> None:
    if capture == "dense" and when == "after":
        pytest.skip("the dense capture stopped after its first exchanges")
    info = exchange(capture, f"{when}_server_info").json()
    loads = exchange(capture, f"{when}_v1_loads").json()
    cap = STARTS[capture]["cap"]
    assert info["max_running_requests"] == CLI_CAP[capture]  # the CLI value, not the cap
    assert effective_cap(loads, info) == cap
    assert effective_cap(None, info) == cap  # internal_states[0] when /v1/loads is not there
    assert effective_cap(loads, None) == cap
    assert check_version(engine_version(info), "real engine").version == "0.5.11"
    assert info["max_req_input_len"] == 8186
    assert loads["loads"][0]["max_total_num_tokens"] == STARTS[capture]["kv"]


@pytest.mark.parametrize("capture", HYBRID)
def test_loads_sampled_under_load_never_exceed_the_cap(capture: str) -> None:
    rows = samples(capture)
    assert max(r["num_running_reqs"] for r in rows) == STARTS[capture]["cap"]
    assert {r["max_running_requests"] for r in rows} == {STARTS[capture]["cap"]}


# --- generation answers through the fleet's client -------------------------------------------


async def _replay(x: Exchange, call: Callable[[EngineClient], Any]) -> Any:
    """Serve ``x``'s captured answer on a local port and run ``call`` with a client of it."""

    async def answer(request: web.Request) -> web.Response:
        kind = x.headers.get("content-type", "application/json")
        return web.Response(status=x.status, body=x.body.encode(),
                            headers={"content-type": kind})

    app = web.Application()
    app.router.add_route("*", x.path.split("?")[0], answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=10.0, max_connections=4)
    try:
        return await call(client)
    finally:
        await client.aclose()
        await runner.cleanup()


def _send(x: Exchange) -> Any:
    """Send ``x``'s request through EngineClient.complete (as the batch runner does)."""
    body = x.request or {}
    if x.path == "/v1/chat/completions":
        sampling = Sampling(max_new_tokens=body.get("max_tokens"))
        return asyncio.run(_replay(x, lambda c: c.complete(None, body["messages"], sampling)))
    params = body.get("sampling_params") or {}
    sampling = Sampling(max_new_tokens=params.get("max_new_tokens"))
    return asyncio.run(_replay(x, lambda c: c.complete(str(body.get("text", "")), None, sampling)))


REJECTED = ["bad_temperature", "bad_top_p", "len9000_max1", "len8188_max1", "len8187_max1",
            "len7992_max500", "text_too_long", "chat_max_tokens_over_ctx"]
FAILED = ["unknown_key_seed", "unknown_key_user", "unknown_key_logprobs"]


@pytest.mark.parametrize("capture", HYBRID)
@pytest.mark.parametrize("suffix", REJECTED)
def test_every_400_is_a_rejected_prompt_with_the_engines_message(capture: str, suffix: str
                                                                 ) -> None:
    x = exchange(capture, suffix)
    assert x.status == 400
    with pytest.raises(PromptRejected) as err:
        _send(x)
    message = x.json().get("message") or x.json()["error"]["message"]
    assert message[:120] in str(err.value)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("suffix", FAILED)
def test_an_unknown_sampling_key_is_a_failed_prompt(capture: str, suffix: str) -> None:
    if capture == "dense" and suffix != "unknown_key_seed":
        pytest.skip("the dense capture sent only the seed key")
    x = exchange(capture, suffix)
    assert (x.status, x.body) == (500, "Internal Server Error")
    assert x.headers["content-type"].startswith("text/plain")
    with pytest.raises(PromptFailed, match="Internal Server Error"):
        _send(x)


@pytest.mark.parametrize("capture", HYBRID)
def test_generate_answers_parse_with_mtp_meta_info(capture: str) -> None:
    for suffix in ("generate_plain", "generate_greedy", "generate_input_ids", "len8184_max1",
                   "len7592_max500", "unknown_top_level_key", "sampling_seed", "full_params"):
        x = exchange(capture, suffix)
        done = _send(x)
        meta = x.json()["meta_info"]
        assert done.finish_reason == "length"
        assert done.completion_tokens == meta["completion_tokens"] > 0
        assert done.prompt_tokens == meta["prompt_tokens"]
        assert done.latency_s == pytest.approx(meta["e2e_latency"])
        assert done.logprobs is None
        if meta["completion_tokens"] > 1:  # a 1-token answer has no verify step
            spec = {k for k in meta if k.startswith("spec_")}
            assert spec == {"spec_accept_rate", "spec_accept_length", "spec_accepted_drafts",
                            "spec_proposed_drafts", "spec_verify_ct", "spec_accept_histogram"}
            assert meta["spec_verify_ct"] == meta["completion_tokens"] - 1


@pytest.mark.parametrize("capture", HYBRID)
def test_generate_logprobs_are_kept_as_the_engine_wrote_them(capture: str) -> None:
    top = exchange(capture, "logprobs_top3_start0")
    meta = top.json()["meta_info"]
    kept = _send(top).logprobs
    assert set(kept) == {"input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                         "output_top_logprobs"}
    assert kept["input_token_logprobs"][0] == [None, kept["input_token_logprobs"][0][1], None]
    assert len(kept["input_token_logprobs"]) == meta["prompt_tokens"]
    assert len(kept["output_token_logprobs"]) == meta["completion_tokens"]
    assert all(len(row) == 3 for row in kept["output_top_logprobs"])
    assert orjson.loads(orjson.dumps(kept)) == kept  # what the data set's column stores
    with_text = _send(exchange(capture, "logprobs_text")).logprobs
    assert with_text["input_token_logprobs"] == []  # default logprob_start_len: output only
    assert all(isinstance(t[2], str) for t in with_text["output_token_logprobs"])


@pytest.mark.parametrize("capture", HYBRID)
def test_batch_and_n2_answer_one_item_per_output(capture: str) -> None:
    for suffix, count in (("generate_batch2", 2), ("generate_n2", 2)):
        items = exchange(capture, suffix).json()
        assert isinstance(items, list) and len(items) == count
        assert [parse_generate(i, 0.0).finish_reason for i in items] == ["length"] * count


@pytest.mark.parametrize("capture", HYBRID)
def test_chat_with_the_reasoning_parser(capture: str) -> None:
    for suffix, thinking in (("chat_plain", True), ("template_kwargs_think", True),
                             ("template_kwargs_nothink", False), ("seed_user_unknown", True)):
        x = exchange(capture, suffix)
        usage = x.json()["usage"]
        done = _send(x)
        assert done.completion_tokens == usage["completion_tokens"]
        assert done.prompt_tokens == usage["prompt_tokens"]
        assert done.finish_reason == "length"
        # No </think> came from random weights: every token is reasoning when thinking is on.
        assert usage["reasoning_tokens"] == (usage["completion_tokens"] if thinking else 0)
        assert done.text == "" and done.reasoning is None  # the stand-in vocabulary decodes ""
    logprobs = _send(exchange(capture, "chat_logprobs")).logprobs
    entry = logprobs["content"][0]
    assert set(entry) == {"token", "bytes", "logprob", "top_logprobs"}
    assert set(entry["top_logprobs"][0]) == {"token", "bytes", "logprob"}


@pytest.mark.parametrize("capture", HYBRID)
def test_streams_are_sse_with_cumulative_ids_and_a_done_marker(capture: str) -> None:
    gen = exchange(capture, "generate_stream")
    events = gen.events()
    assert gen.status == 200 and gen.streamed and events[-1] == "[DONE]"
    lengths = [len(e["output_ids"]) for e in events[:-1]]
    assert lengths == list(range(1, len(lengths) + 1))  # /generate repeats the ids so far
    chat = exchange(capture, "chat_stream").events()
    assert chat[-1] == "[DONE]" and chat[-2]["choices"] == [] and "usage" in chat[-2]


@pytest.mark.parametrize("capture", HYBRID)
def test_the_workers_engine_sample_reads_real_metrics_and_loads(capture: str) -> None:
    cap = STARTS[capture]["cap"]
    before = exchange(capture, "before_v1_loads").json()
    loaded = sample_from(text(capture, "load_metrics_t10.txt"), before)
    assert loaded is not None
    # Running and queued are /v1/loads' (read live; here the idle one before the load), the
    # gauges' only without it (issue 45: they lag, load_samples.jsonl below).
    assert (loaded.running, loaded.queued, loaded.cap) == (0, 0, cap)
    gauges = sample_from(text(capture, "load_metrics_t10.txt"), None)
    assert gauges is not None and gauges.running == cap
    assert gauges.queued is not None and gauges.queued > 100
    assert loaded.kv_usage is not None and loaded.kv_usage < 0.05  # the KV pool, not Mamba's
    assert loaded.mamba_usage == pytest.approx(0.8, abs=0.05)
    assert loaded.accept_length == pytest.approx(1.0, abs=0.05)
    idle = sample_from(None, before)  # no speculative section before the first decode step
    assert idle is not None and idle.accept_length is None and idle.cap == cap
    after = sample_from(None, exchange(capture, "after_v1_loads").json())
    assert after is not None and after.accept_length == pytest.approx(1.0, abs=0.01)
