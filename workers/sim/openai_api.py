"""OpenAI-compatible endpoints of the simulator (``srt/entrypoints/openai/``), non-streaming.

Reasoning: with ``--reasoning-parser`` set and thinking not disabled (``chat_template_kwargs.
enable_thinking`` is not False and ``reasoning_effort`` is not "none"), the first 80 % of the drawn
output length goes to ``message.reasoning_content`` and the rest to ``content``
(:func:`workers.sim.textgen.reasoning_split`; the share is not measured). Without a parser every
token is content.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import orjson
from starlette.routing import Route

from workers.sim.answers import chat_texts, plain_text
from workers.sim.api import NOT_READY, JsonHandler, endpoint, parse_json, text_tokens
from workers.sim.engine import SimRequest
from workers.sim.formats import sim_release
from workers.sim.state import SimState, Uncaught, make_request
from workers.sim.structured import response_schema, tool_calls, validate_tools
from workers.sim.textgen import (
    chat_logprobs,
    completion_logprobs,
    count_chat_tokens,
    count_text_tokens,
    filler_ids,
    reasoning_split,
)


def openai_error(
    message: str, status: int = 400, err_type: str = "BadRequestError"
) -> tuple[int, dict[str, Any]]:
    """SGLang's OpenAI error shape (``ErrorResponse``)."""
    body = {
        "object": "error",
        "message": message,
        "type": err_type,
        "param": None,
        "code": status,
    }
    return status, body


def internal_error(exc: Exception) -> tuple[int, dict[str, Any]]:
    """``OpenAIServingBase.handle_request``: any other exception is a JSON 500."""
    return openai_error(f"Internal server error: {exc}", 500, "InternalServerError")


def _finish(req: SimRequest) -> tuple[str, Any]:
    """OpenAI finish_reason and matched_stop of a finished request."""
    reason = req.finish_reason or {}
    kind = str(reason.get("type") or "abort")
    return kind, reason.get("matched") if kind == "stop" else None


def _usage(reqs: list[SimRequest], reasoning_tokens: int = 0) -> dict[str, Any]:
    """OpenAI usage block."""
    prompt = sum(r.input_len for r in reqs)
    completion = sum(r.generated for r in reqs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": reasoning_tokens,
    }


def _sampling(body: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """Sampling params of an OpenAI body, in /generate terms.

    SGLang's OpenAI routes parse the body into pydantic request models and build the sampling
    dict from named fields (``ChatCompletionRequest.to_sampling_params``, which maps ``seed`` to
    ``sampling_seed``), so an unknown body key (``user``...) never reaches ``SamplingParams``:
    it is ignored here too. ``logprobs``
    and ``top_logprobs`` are request fields (:func:`chat_logprob_request`).
    """
    params = {k: body[k] for k in ("temperature", "top_p", "top_k", "ignore_eos", "regex",
                                   "ebnf") if body.get(k) is not None}
    params["max_new_tokens"] = max_tokens
    if body.get("seed") is not None:  # to_sampling_params: seed -> sampling_seed
        params["sampling_seed"] = body["seed"]
    return params


def _completion_prompts(prompt: Any) -> list[tuple[int, str]]:
    """(input length, text) per prompt of /v1/completions (str, list of str, or token ids)."""
    if isinstance(prompt, str):
        return [(count_text_tokens(prompt), prompt)]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return [(count_text_tokens(p), p) for p in prompt]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return [(len(p), "") for p in prompt]
    if isinstance(prompt, list) and prompt:
        return [(len(prompt), "")]
    raise ValueError("prompt must be a non-empty string, list of strings or token ids.")


def _check_body(body: dict[str, Any]) -> None:
    """Reject what the simulator does not implement, loudly."""
    if body.get("stream"):
        raise ValueError("stream=true is not supported by the simulator (workers.sim).")
    if int(body.get("n") or 1) != 1:
        raise ValueError("n > 1 is not supported by the simulator (workers.sim).")


def completion_logprob_request(body: dict[str, Any]) -> int | None:
    """``CompletionRequest.logprobs`` (``Optional[int]``): the top count, None for none."""
    value = body.get("logprobs")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"logprobs: Input should be a valid integer, got {value!r}")
    return value


def completion_document(state: SimState, done: list[SimRequest], top: int | None = None
                        ) -> dict[str, Any]:
    """The /v1/completions response (``top``: the request's ``logprobs``)."""
    choices = []
    for index, req in enumerate(done):
        kind, matched = _finish(req)
        eos = state.shape.eos_token_id if kind == "stop" else None
        ids = filler_ids(req.generated, eos)
        choices.append(
            {
                "index": index,
                "text": plain_text(text_tokens(req), req.rid),
                "logprobs": None if top is None else completion_logprobs(ids, top),
                "finish_reason": kind,
                "matched_stop": matched,
            }
        )
    return {
        "id": done[0].rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": _usage(done),
        "metadata": {"weight_version": "default"},
    }


def completions_handler(state: SimState) -> JsonHandler:
    """POST /v1/completions (max_tokens defaults to 16, the OpenAI default)."""

    async def completions(raw: bytes) -> tuple[int, Any]:
        if not state.ready:
            return NOT_READY
        try:
            body = parse_json(raw)
            _check_body(body)
            params = _sampling(body, body.get("max_tokens", 16))
            top = completion_logprob_request(body)
            reqs = [
                make_request(state, n, params, text)
                for n, text in _completion_prompts(body.get("prompt"))
            ]
        except Uncaught as exc:
            return internal_error(exc)
        except (ValueError, TypeError) as exc:
            return openai_error(str(exc))
        done = list(await asyncio.gather(*(state.engine.submit(r) for r in reqs)))
        return 200, completion_document(state, done, top)

    return completions


def thinking_on(state: SimState, body: dict[str, Any]) -> bool:
    """Whether the reasoning parser separates thinking for this request (serving_chat.py)."""
    if not state.args.reasoning_parser or body.get("separate_reasoning") is False:
        return False
    kwargs = body.get("chat_template_kwargs") or {}
    if body.get("reasoning_effort") == "none":
        return False
    return kwargs.get("enable_thinking") is not False


def chat_message(req: SimRequest, thinking: bool,
                 calls: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], int]:
    """The assistant message and its reasoning token count (``calls``: the tool calls the
    engine's parser found, workers/sim/structured.py)."""
    words = text_tokens(req)
    reasoning = 0
    if thinking:
        reasoning, _ = reasoning_split(req.generated, req.drawn_len)
    content, reasoning_text = chat_texts(words, reasoning, thinking, req.rid)
    if req.json_text is not None:
        content = req.json_text
    message = {
        "role": "assistant",
        "content": None if calls else content,
        "reasoning_content": reasoning_text,
        "tool_calls": calls or None,
    }
    return message, reasoning


def chat_document(state: SimState, req: SimRequest, thinking: bool,
                  logprob: tuple[bool, int] = (False, 0),
                  calls: list[dict[str, Any]] | None = None,
                  token_ids: bool = False) -> dict[str, Any]:
    """The /v1/chat/completions response (``logprob``: :func:`chat_logprob_request`;
    ``calls``: the parsed tool calls, which make the finish reason ``tool_calls`` as
    ``OpenAIServingChat._build_chat_response`` does; ``token_ids``: the request's
    ``return_token_ids``, answered under the played release's choice key, if it has one)."""
    message, reasoning = chat_message(req, thinking, calls)
    kind, matched = _finish(req)
    if calls and kind == "stop":
        kind, matched = "tool_calls", None
    # Every generated token, the stop token included, as output_token_logprobs holds them.
    eos = state.shape.eos_token_id if kind == "stop" else None
    logprobs = chat_logprobs(filler_ids(req.generated, eos), logprob[1]) if logprob[0] else None
    choice = {
        "index": 0,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": kind,
        "matched_stop": matched,
    }
    if token_ids and (key := sim_release(state.version).chat_token_ids_key):
        choice[key] = filler_ids(req.generated, eos)
    return {
        "id": req.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [choice],
        "usage": _usage([req], reasoning),
        "metadata": {"weight_version": "default"},
    }


def chat_logprob_request(body: dict[str, Any]) -> tuple[bool, int]:
    """(return_logprob, top_logprobs_num) of a chat body, typed as ``ChatCompletionRequest``
    declares them (``logprobs: bool``, ``top_logprobs: Optional[int]``; a value pydantic would
    refuse is a ValueError, answered 400) and passed on as ``OpenAIServingChat`` does
    (``return_logprob=request.logprobs, top_logprobs_num=request.top_logprobs or 0``).
    Stricter than pydantic's lax mode: strings such as "true" or "2" are refused too."""
    logprobs, top = body.get("logprobs", False), body.get("top_logprobs")
    if not (isinstance(logprobs, bool) or (type(logprobs) is int and logprobs in (0, 1))):
        raise ValueError(f"logprobs: Input should be a valid boolean, got {logprobs!r}")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise ValueError(f"top_logprobs: Input should be a valid integer, got {top!r}")
    return bool(logprobs), top or 0


def build_chat(state: SimState, body: dict[str, Any]) -> SimRequest:
    """Validated SimRequest of a chat body (max_tokens None means up to the context)."""
    _check_body(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list.")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    context = state.args.context_length  # the --context-length flag, None when not given
    if max_tokens and context and max_tokens > context and not state.args.allow_auto_truncate:
        # OpenAIServingChat._validate_request (0.5.11): answered before tokenizing.
        raise ValueError(
            f"max_completion_tokens is too large: {max_tokens}."
            f"This model supports at most {context} completion tokens."
        )
    validate_tools(body)
    text = "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    rid = str(body.get("rid") or f"chatcmpl-{uuid.uuid4().hex}")
    key = orjson.dumps(messages).decode()
    params = _sampling(body, max_tokens)
    if (schema := response_schema(body)) is not None:
        # _build_sampling_params: the response_format's schema becomes the json_schema grammar.
        params["json_schema"] = orjson.dumps(schema).decode()
    return make_request(state, count_chat_tokens(messages), params, text, rid, key)


def chat_handler(state: SimState) -> JsonHandler:
    """POST /v1/chat/completions."""

    async def chat(raw: bytes) -> tuple[int, Any]:
        if not state.ready:
            return NOT_READY
        try:
            body = parse_json(raw)
            req = build_chat(state, body)
            logprob = chat_logprob_request(body)
        except Uncaught as exc:
            return internal_error(exc)
        except (ValueError, TypeError) as exc:
            return openai_error(str(exc))
        calls = tool_calls(body, f"{orjson.dumps(body.get('messages')).decode()}\0"
                           f"{body.get('seed')}", state.args.tool_call_parser)
        done = await state.engine.submit(req)
        return 200, chat_document(state, done, thinking_on(state, body), logprob, calls,
                                  body.get("return_token_ids") is True)

    return chat


def openai_routes(state: SimState) -> list[Route]:
    """Routes of the OpenAI-compatible API."""
    return [
        Route("/v1/completions", endpoint(completions_handler(state)), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(chat_handler(state)), methods=["POST"]),
    ]
