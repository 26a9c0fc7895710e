"""SGLang's native HTTP API on the simulated scheduler (``srt/entrypoints/http_server.py``)."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from workers.sim.engine import SimRequest
from workers.sim.formats import shape_loads, shape_server_info, sim_release
from workers.sim.report import log
from workers.sim.state import (
    SimState,
    probe_request,
)

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


def as_list(value: Any, count: int) -> list[Any]:
    """Broadcast a per-request field (single value or list) to ``count`` entries."""
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"Expected {count} entries, got {len(value)}.")
        return value
    return [value] * count


def text_tokens(req: SimRequest) -> int:
    """Tokens that appear as text (EOS is a special token and is skipped)."""
    stopped = (req.finish_reason or {}).get("type") == "stop"
    return max(0, req.generated - 1) if stopped else req.generated


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
    """The /server_info document (in the played release's shape)."""
    doc = {
        **state.server_args,
        "status": "ready",
        "max_total_num_tokens": state.plan.max_total_num_tokens,
        "max_req_input_len": state.plan.max_req_input_len,
        "internal_states": [internal_state(state)],
        "version": state.version,
    }
    return shape_server_info(doc, sim_release(state.version), state.speculative,
                             state.started_at)


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
    return shape_loads({
        "timestamp": datetime.now(UTC).isoformat(),
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
    }, sim_release(state.version))


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
        Route("/server_info", make_server_info(state), methods=["GET"]),
        Route("/get_server_info", make_server_info(state, "/get_server_info"), methods=["GET"]),
        Route("/v1/loads", make_loads(state), methods=["GET"]),
        Route("/get_load", make_get_load(state), methods=["GET"]),
    ]
