"""SGLang's native HTTP API on the simulated scheduler (``srt/entrypoints/http_server.py``)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from workers.sim.engine import SimRequest
from workers.sim.report import log
from workers.sim.state import (
    SimState,
    Uncaught,
    make_request,
    probe_request,
)
from workers.sim.textgen import count_text_tokens, filler_ids, filler_text, token_logprobs

HEALTH_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
GB = 1024**3


# A JSON endpoint: raw request body -> (HTTP status, JSON-able payload).
JsonHandler = Callable[[bytes], Awaitable[tuple[int, Any]]]
# A Starlette endpoint.
Endpoint = Callable[[Request], Awaitable[Response]]
NOT_READY = (503, {"error": {"message": "The server is not ready yet (loading weights)."}})


class PlainText(str):
    """A handler result sent as text/plain instead of JSON."""


# Starlette's ServerErrorMiddleware answer to an exception no handler caught.
INTERNAL_ERROR = (500, PlainText("Internal Server Error"))


def json_response(data: Any, status: int = 200) -> Response:
    """A JSON response serialised with orjson (a :class:`PlainText` result goes as text)."""
    if isinstance(data, PlainText):
        return PlainTextResponse(str(data), status_code=status)
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def error_payload(message: str) -> dict[str, Any]:
    """SGLang's native error shape: ``{"error": {"message": ...}}``."""
    return {"error": {"message": message}}


def not_ready() -> Response:
    """503 while the simulated weights are loading."""
    return json_response(NOT_READY[1], NOT_READY[0])


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object (ValueError when it is not one)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("The request body must be a JSON object.")
    return body


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object (ValueError when it is not one)."""
    return parse_json(await request.body())


def endpoint(handler: JsonHandler) -> Endpoint:
    """A Starlette endpoint around a JSON handler (the fast path serves the same handler)."""

    async def call(request: Request) -> Response:
        status, data = await handler(await request.body())
        return json_response(data, status)

    return call


def _as_list(value: Any, count: int) -> list[Any]:
    """Broadcast a per-request field (single value or list) to ``count`` entries."""
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"Expected {count} entries, got {len(value)}.")
        return value
    return [value] * count


def _prompts(body: dict[str, Any]) -> tuple[list[tuple[int, str, str, Any]], bool]:
    """(input length, text, identity, token ids) per prompt of a /generate body, and whether it
    is a batch. The identity (the text, or the token ids) seeds the prompt's output length.
    """
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, str):
        return [(count_text_tokens(text), text, text, None)], False
    if isinstance(text, list):
        return [(count_text_tokens(str(t)), str(t), str(t), None) for t in text], True
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return [(len(x), "", str(x), x) for x in ids], True
    if isinstance(ids, list) and ids:
        return [(len(ids), "", str(ids), ids)], False
    raise ValueError("Either text or input_ids should be provided.")


def build_generate(state: SimState, body: dict[str, Any]) -> tuple[list[SimRequest], bool]:
    """Validated SimRequests of a /generate body (ValueError -> 400)."""
    prompts, batch = _prompts(body)
    params = _as_list(body.get("sampling_params") or {}, len(prompts))
    rids = _as_list(body.get("rid"), len(prompts))
    named = [r for r in rids if r is not None]
    if len(set(named)) < len(named):
        raise ValueError("Duplicate request IDs in the batch.")
    if body.get("stream"):
        raise ValueError("stream=true is not supported by the simulator (workers.sim).")
    reqs = []
    for (n, text, key, ids), p, rid in zip(prompts, params, rids, strict=True):
        copies = int((p or {}).get("n") or 1)
        # GenerateReqInput._handle_parallel_sampling: n > 1 answers a list of n results.
        batch = batch or copies > 1
        for copy in range(copies):
            copy_rid = rid if copies == 1 or rid is None else f"{rid}_{copy}"
            reqs.append(make_request(state, n, p or {}, text, copy_rid, f"{key}\0{copy}"
                                     if copy else key, ids))
    return reqs, batch


def spec_meta(state: SimState, req: SimRequest) -> dict[str, Any]:
    """Speculative fields of meta_info (``TokenizerManager._calculate_spec_decoding_metrics``,
    0.5.11): none before the first verify step; ``spec_accept_histogram[k]`` counts the verify
    steps that accepted ``k`` drafts (``Req.update_spec_acceptance_histogram``). The sim spreads
    the accepted drafts evenly over the steps (it keeps no per-step record)."""
    verify = req.verify_ct
    if not state.speculative or verify == 0:
        return {}
    proposed = verify * (state.plan.num_draft_tokens - 1)
    accepted = max(0, req.generated - 1 - verify)  # prefill token and bonus tokens out
    per_step, extra = divmod(accepted, verify)
    histogram = [0] * (per_step + (2 if extra else 1))
    histogram[per_step] += verify - extra
    if extra:
        histogram[per_step + 1] += extra
    return {
        "spec_accept_rate": accepted / proposed if proposed else 0.0,
        "spec_accept_length": req.generated / verify,
        "spec_accepted_drafts": accepted,
        "spec_proposed_drafts": proposed,
        "spec_verify_ct": verify,
        "spec_accept_histogram": histogram,
    }


def text_tokens(req: SimRequest) -> int:
    """Tokens that appear as text (EOS is a special token and is skipped)."""
    stopped = (req.finish_reason or {}).get("type") == "stop"
    return max(0, req.generated - 1) if stopped else req.generated


@dataclass(frozen=True)
class LogprobAsk:
    """A /generate request's logprob fields (``GenerateReqInput``)."""

    top: int = 0  # top_logprobs_num
    start: int = -1  # logprob_start_len; -1: output tokens only
    with_text: bool = False  # return_text_in_logprobs

    def prompt_ids(self, req: SimRequest) -> list[int]:
        """The prompt tokens whose logprobs are returned (from ``start`` on)."""
        if self.start < 0:
            return []
        ids = req.prompt_ids if req.prompt_ids is not None else filler_ids(req.input_len)
        return ids[self.start:]


def logprob_asks(body: dict[str, Any], count: int) -> list[LogprobAsk | None]:
    """One LogprobAsk per result (None where ``return_logprob`` is off)."""
    on = _as_list(body.get("return_logprob") or False, count)
    top = _as_list(body.get("top_logprobs_num") or 0, count)
    start = _as_list(body.get("logprob_start_len", -1), count)
    text = bool(body.get("return_text_in_logprobs"))
    return [LogprobAsk(int(k or 0), int(-1 if s is None else s), text) if lp else None
            for lp, k, s in zip(on, top, start, strict=True)]


def generate_result(state: SimState, req: SimRequest, ask: LogprobAsk | None = None
                    ) -> dict[str, Any]:
    """One /generate response item (``ask``: its logprob fields, None without logprobs)."""
    stopped = (req.finish_reason or {}).get("type") == "stop"
    eos = state.shape.eos_token_id if stopped else None
    ids = filler_ids(req.generated, eos)
    # Keys in the order 0.5.11 writes them (TokenizerManager._handle_batch_output).
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": req.input_len,
        "weight_version": "default",
        "total_retractions": req.retractions,
        "queue_time": req.queue_s,
        "prefill_waiting_latency": None,
        "prefill_launch_latency": None,
    }
    if ask is not None:
        meta.update(token_logprobs(ids, ask.top, ask.prompt_ids(req), ask.with_text))
    now = time.time()
    meta.update({
        "reasoning_tokens": 0,
        "completion_tokens": req.generated,
        "cached_tokens": req.cached_tokens,
        "cached_tokens_details": None,
        "dp_rank": None,
        "e2e_latency": req.latency,
        **spec_meta(state, req),
        "request_received_ts": now - req.latency,
        "api_server_dispatch_finish_ts": now - req.latency,
        "request_finished_ts": now,
        "inference_time": req.latency,
        "decode_throughput": req.generated / req.latency if req.latency > 0 else 0.0,
        "response_sent_to_client_ts": now,
    })
    return {"text": filler_text(text_tokens(req)), "output_ids": ids, "meta_info": meta}


def generate_handler(state: SimState) -> JsonHandler:
    """POST /generate."""

    async def generate(raw: bytes) -> tuple[int, Any]:
        if not state.ready:
            return NOT_READY
        try:
            body = parse_json(raw)
            reqs, batch = build_generate(state, body)
        except Uncaught as exc:
            # http_server.generate_request catches only ValueError: the TypeError reaches
            # Starlette's ServerErrorMiddleware, which answers a bare text 500 (0.5.10-0.5.11).
            log(f"Exception in ASGI application: TypeError: {exc}")
            return INTERNAL_ERROR
        except (ValueError, TypeError) as exc:
            return 400, error_payload(str(exc))
        done = await asyncio.gather(*(state.engine.submit(r) for r in reqs))
        asks = logprob_asks(body, len(done))
        items = [generate_result(state, r, ask) for r, ask in zip(done, asks, strict=True)]
        return 200, items if batch else items[0]

    return generate


def make_health(state: SimState) -> Endpoint:
    """GET /health and /health_generate: a 1-token probe through the scheduler
    (routes ``/health`` and ``/health_generate``, SGLang 0.5.11
    ``srt/entrypoints/http_server.py``)."""

    async def health(request: Request) -> Response:
        if not state.ready:
            return Response(status_code=503)
        probe = probe_request()
        state.engine.submit(probe)
        if await state.engine.wait_output(HEALTH_TIMEOUT_S):
            return Response(status_code=200)
        state.engine.abort(probe.rid)
        return Response(status_code=503)

    return health


def memory_usage(state: SimState) -> dict[str, float]:
    """``memory_usage`` of /server_info internal_states (GB = GiB)."""
    mem = state.plan.memory_gib
    return {
        "weight": round(mem["weights"], 2),
        "kvcache": round(mem["kv"], 2),
        "token_capacity": state.plan.max_total_num_tokens,
        "graph": round(state.plan.cuda_graph_gib, 2),
    }


def internal_state(state: SimState) -> dict[str, Any]:
    """One ``internal_states`` entry (``Scheduler.get_internal_state``)."""
    entry = dict(state.server_args)
    entry.update(
        max_mamba_cache_size=state.plan.max_mamba_cache_size if state.shape.hybrid else None,
        effective_max_running_requests_per_dp=state.plan.max_running_requests,
        memory_usage=memory_usage(state),
        last_gen_throughput=state.engine.last_gen_throughput,
    )
    if state.speculative and state.engine.lifetime_req_steps:  # after the first decode step
        entry["avg_spec_accept_length"] = state.engine.avg_accept_length()
    return entry


def server_info(state: SimState) -> dict[str, Any]:
    """The /server_info document."""
    return {
        **state.server_args,
        "status": "ready",
        "max_total_num_tokens": state.plan.max_total_num_tokens,
        "max_req_input_len": state.plan.max_req_input_len,
        "internal_states": [internal_state(state)],
        "version": state.version,
    }


def make_server_info(state: SimState, deprecated: str | None = None) -> Endpoint:
    """GET /server_info (and the deprecated alias, which logs a warning on every call)."""

    async def info(request: Request) -> Response:
        if deprecated:
            log(f"Endpoint '{deprecated}' is deprecated. Please use '/server_info' instead.")
        if not state.ready:
            return not_ready()
        return json_response(server_info(state))

    return info


def load_entry(state: SimState) -> dict[str, Any]:
    """``loads[0]`` of /v1/loads (``SchedulerMetricsMixin.get_loads`` and
    ``v1_loads.get_loads``, 0.5.11): None fields are left out (``dp_rank`` at dp 1, and
    ``speculative`` until the first decode step), ``token_usage`` is the full KV pool's,
    ``num_total_tokens`` adds the waiting prompts to the used tokens, memory in GB to 3 places."""
    engine = state.engine
    snap = engine.snapshot()
    plan, mem = state.plan, state.plan.memory_gib
    metrics_on = state.metrics is not None  # gen_throughput comes from stats: 0 without metrics
    waiting = sum(r.held for r in engine.waiting)
    entry: dict[str, Any] = {
        "num_running_reqs": snap.running,
        "num_waiting_reqs": snap.queued,
        "num_used_tokens": snap.used_tokens,
        "num_total_tokens": snap.used_tokens + waiting,
        "max_total_num_tokens": plan.max_total_num_tokens,
        "token_usage": round(snap.full_usage, 4),
        "gen_throughput": round(engine.last_gen_throughput, 2) if metrics_on else 0.0,
        "cache_hit_rate": 0.0,
        "utilization": 0.0,
        "max_running_requests": plan.max_running_requests,
        "memory": {
            "weight_gb": round(mem["weights"], 3),
            "kv_cache_gb": round(mem["kv"], 3),
            "graph_gb": round(plan.cuda_graph_gib, 3),
            "token_capacity": plan.max_total_num_tokens,
        },
    }
    if state.speculative and engine.lifetime_req_steps:
        entry["speculative"] = {"accept_length": engine.avg_accept_length(),
                                "accept_rate": state.reporter.interval.accept_rate}
    entry["disaggregation"] = {
        "mode": "null", "prefill_prealloc_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
        "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0,
        "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0,
        "kv_transfer_latency_ms": 0.0,
    }
    entry["queues"] = {"waiting": snap.queued, "grammar": 0, "paused": 0, "retracted": 0}
    entry["num_total_reqs"] = snap.running + snap.queued
    return entry


def loads_document(state: SimState) -> dict[str, Any]:
    """The /v1/loads JSON document (``v1_loads._compute_aggregate`` for the aggregate)."""
    entry = load_entry(state)
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": state.version,
        "dp_rank_count": 1,
        "loads": [entry],
        "aggregate": {
            "total_running_reqs": entry["num_running_reqs"],
            "total_waiting_reqs": entry["num_waiting_reqs"],
            "total_reqs": entry["num_total_reqs"],
            "total_used_tokens": entry["num_used_tokens"],
            "total_tokens": entry["num_total_tokens"],
            "avg_token_usage": entry["token_usage"],
            "avg_throughput": entry["gen_throughput"],
            "avg_utilization": 0.0,
        },
    }


def loads_prometheus(entry: dict[str, Any]) -> str:
    """``/v1/loads?format=prometheus`` (``v1_loads._format_loads_prometheus``): the
    ``GetLoadsReqOutput`` fields, then the memory section as ``sglang_memory_*``; the label is
    ``dp_rank="None"`` at dp 1, as the f-string writes a None rank."""
    lines = []
    for key, value in entry.items():
        if isinstance(value, int | float) and key != "num_total_reqs":
            lines.append(f'sglang_{key}{{dp_rank="None"}} {value}')
    for key, value in entry["memory"].items():
        lines.append(f'sglang_memory_{key}{{dp_rank="None"}} {value}')
    return "\n".join(lines) + "\n"


def make_loads(state: SimState) -> Endpoint:
    """GET /v1/loads."""

    async def loads(request: Request) -> Response:
        document = loads_document(state)
        if request.query_params.get("format") == "prometheus":
            return PlainTextResponse(loads_prometheus(document["loads"][0]))
        return json_response(document)

    return loads


def make_get_load(state: SimState) -> Endpoint:
    """GET /get_load: the deprecated shim over /v1/loads (``http_server.get_load``, 0.5.11),
    which warns on every call and answers ``ts_tic`` from ``time.perf_counter``."""

    async def get_load(request: Request) -> Response:
        log("Endpoint '/get_load' is deprecated and will be removed in a future version. "
            "Please use '/v1/loads' instead.")
        entry = load_entry(state)
        item = {
            "dp_rank": None,
            "num_reqs": entry["num_running_reqs"] + entry["num_waiting_reqs"],
            "num_waiting_reqs": entry["num_waiting_reqs"],
            "num_tokens": entry["num_total_tokens"],
            "num_pending_tokens": entry["num_total_tokens"] - entry["num_used_tokens"],
            "ts_tic": time.perf_counter(),
        }
        return json_response([item])

    return get_load


def native_routes(state: SimState) -> list[Route]:
    """Routes of SGLang's native API."""
    health = make_health(state)
    return [
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/generate", endpoint(generate_handler(state)), methods=["POST", "PUT"]),
        Route("/server_info", make_server_info(state), methods=["GET"]),
        Route("/get_server_info", make_server_info(state, "/get_server_info"), methods=["GET"]),
        Route("/v1/loads", make_loads(state), methods=["GET"]),
        Route("/get_load", make_get_load(state), methods=["GET"]),
    ]
