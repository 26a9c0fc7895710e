"""Model and admin endpoints of the simulator: model info, model list, cache, abort, metrics."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from workers.sim.api import Endpoint, json_response, read_json
from workers.sim.state import SimState

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


def model_info(state: SimState) -> dict[str, object]:
    """The /model_info document (route ``/model_info`` of SGLang 0.5.11
    ``srt/entrypoints/http_server.py``)."""
    return {
        "model_path": state.args.model_path,
        "tokenizer_path": state.args.tokenizer_path or state.args.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.args.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": state.shape.model_type,
        "architectures": [state.shape.architecture],
    }


def make_model_info(state: SimState) -> Endpoint:
    """GET /model_info and /get_model_info."""

    async def info(request: Request) -> Response:
        return json_response(model_info(state))

    return info


def make_models(state: SimState) -> Endpoint:
    """GET /v1/models (OpenAI model list)."""

    async def models(request: Request) -> Response:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": int(state.started_at),
            "owned_by": "sglang",
            "root": state.args.model_path,
            "parent": None,
            "max_model_len": state.plan.context_len,
        }
        return json_response({"object": "list", "data": [card]})

    return models


def make_flush_cache(state: SimState) -> Endpoint:
    """GET/POST /flush_cache: 400 while requests are running or waiting."""

    async def flush(request: Request) -> Response:
        snap = state.engine.snapshot()
        if snap.running or snap.queued:
            message = (
                "Cache not flushed because there are pending requests. "
                f"#queue-req: {snap.queued}, #running-req: {snap.running}"
            )
            return PlainTextResponse(message, status_code=400)
        state.engine.cache.clear()
        return PlainTextResponse(FLUSHED)

    return flush


def make_abort(state: SimState) -> Endpoint:
    """POST /abort_request: ``{"rid": ..., "abort_all": false}``; 200 with an empty body."""

    async def abort(request: Request) -> Response:
        try:
            body = await read_json(request)
        except ValueError:
            body = {}
        if body.get("abort_all"):
            state.engine.abort(None)
        elif body.get("rid"):
            state.engine.abort(str(body["rid"]))
        return Response(status_code=200)

    return abort


def make_metrics(state: SimState) -> Endpoint:
    """GET /metrics (only mounted with --enable-metrics)."""

    async def metrics(request: Request) -> Response:
        assert state.metrics is not None
        return Response(state.metrics.render(), media_type=PROMETHEUS_TEXT)

    return metrics


def admin_routes(state: SimState) -> list[Route]:
    """Model, admin and (with --enable-metrics) metrics routes."""
    info = make_model_info(state)
    routes = [
        Route("/model_info", info, methods=["GET"]),
        Route("/get_model_info", info, methods=["GET"]),
        Route("/v1/models", make_models(state), methods=["GET"]),
        Route("/flush_cache", make_flush_cache(state), methods=["GET", "POST"]),
        Route("/abort_request", make_abort(state), methods=["POST"]),
    ]
    if state.metrics is not None:
        routes.append(Route("/metrics", make_metrics(state), methods=["GET"]))
    return routes
