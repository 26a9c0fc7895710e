"""HTTP client for one SGLang (or simulated) engine.

Speaks SGLang's native ``/generate`` for plain prompts and ``/v1/chat/completions`` for chat
messages, and reads the engine's effective running cap. Transport errors and status codes are
translated here: 400 -> PromptRejected, 500 -> PromptFailed (a few tries if the engine is still
healthy), connection errors / other 5xx / timeouts -> EngineUnavailable.

The transport is aiohttp: a worker sends every prompt through here, and httpx's connection
pool bookkeeping cost ~2 ms of CPU per request at 50-100 connections (bench/overhead.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from workers.errors import ENGINE_REJECTED, EngineUnavailable, PromptFailed, PromptRejected


@dataclass(frozen=True)
class Sampling:
    """What a request carries besides the prompt (workers/engine/sampling.py builds it)."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # Further fields in the route's own names: SamplingParams keywords for /generate,
    # ChatCompletionRequest fields for chat.
    extra: dict[str, Any] | None = None
    # /generate top-level fields (return_logprob, top_logprobs_num).
    request: dict[str, Any] | None = None
    # Send plain prompts as one user message through the chat template.
    chat: bool = False
    # Prepended to chat messages that have no system message.
    system_prompt: str | None = None


@dataclass(frozen=True)
class Completion:
    """What one request produced."""

    text: str
    reasoning: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    # What the engine answered for a request that asked for logprobs (None otherwise):
    # /generate's meta_info ``*_logprobs`` fields, or the chat choice's ``logprobs``.
    logprobs: Any = None
    # The chat message's ``tool_calls`` as the engine parsed them (the profile's
    # --tool-call-parser; ``OpenAIServingChat._process_tool_calls``), None when there are none.
    tool_calls: Any = None
    # The engine's own sampled token ids (:func:`parse_generate`, :func:`parse_chat`).
    output_ids: list[int] | None = None


def _ids(raw: Any) -> list[int] | None:
    """A list of token ids as the engine sent it, or None."""
    if not isinstance(raw, list):
        return None
    return [int(x) for x in raw]


def _finish_reason(raw: Any) -> str:
    """SGLang's native finish_reason is a dict ({"type": "length", ...}); OpenAI's a string."""
    if isinstance(raw, dict):
        return str(raw.get("type") or "unknown")
    return str(raw) if raw else "unknown"


def _generate_body(prompt: str, sampling: Sampling) -> dict[str, Any]:
    params: dict[str, Any] = dict(sampling.extra or {})
    # Always sent: SGLang's /generate defaults to 128 tokens, while null means "up to the
    # context", which is what chat requests get when max_tokens is unset.
    params["max_new_tokens"] = sampling.max_new_tokens
    if sampling.temperature is not None:
        params["temperature"] = sampling.temperature
    if sampling.top_p is not None:
        params["top_p"] = sampling.top_p
    return {"text": prompt, "sampling_params": params, **(sampling.request or {})}


def chat_messages(prompt: str | None, messages: list[Any] | None,
                  sampling: Sampling) -> list[Any] | None:
    """The messages of a chat request (None: a plain /generate prompt)."""
    if messages is None and sampling.chat:
        messages = [{"role": "user", "content": prompt or ""}]
    if messages is None or not sampling.system_prompt:
        return messages
    if any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        return messages  # the row's own system message wins
    return [{"role": "system", "content": sampling.system_prompt}, *messages]


def chat_body(messages: list[Any], sampling: Sampling) -> dict[str, Any]:
    """The body of one ``/v1/chat/completions`` request."""
    # return_token_ids: the choice carries the sampled ids from SGLang 0.5.17 on
    # (serving_chat.py::_build_chat_response); older releases ignore the unknown key, as they
    # ignore any (protocol.py::ChatCompletionRequest takes pydantic's default, extra="ignore").
    body: dict[str, Any] = {"messages": messages, "return_token_ids": True,
                            **(sampling.extra or {})}
    if sampling.max_new_tokens is not None:
        body["max_tokens"] = sampling.max_new_tokens
    if sampling.temperature is not None:
        body["temperature"] = sampling.temperature
    if sampling.top_p is not None:
        body["top_p"] = sampling.top_p
    return body


def parse_generate(data: dict[str, Any], latency_s: float) -> Completion:
    """Parse a native /generate response (``text`` + ``meta_info``)."""
    meta = data.get("meta_info") or {}
    return Completion(
        text=data.get("text") or "",
        reasoning=None,
        finish_reason=_finish_reason(meta.get("finish_reason")),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=int(meta.get("completion_tokens") or 0),
        latency_s=float(meta.get("e2e_latency") or latency_s),
        # TokenizerManager.add_logprob_to_meta_info: input/output token and top logprobs.
        logprobs={k: v for k, v in meta.items() if k.endswith("logprobs")} or None,
        # TokenizerManager._handle_batch_output: every sampled id, the stop token included.
        output_ids=_ids(data.get("output_ids")),
    )


def parse_chat(data: dict[str, Any], latency_s: float) -> Completion:
    """Parse an OpenAI chat completion (reasoning in ``message.reasoning_content``)."""
    choice = (data.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    usage = data.get("usage") or {}
    return Completion(
        text=message.get("content") or "",
        reasoning=message.get("reasoning_content"),
        finish_reason=_finish_reason(choice.get("finish_reason")),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        latency_s=latency_s,
        logprobs=choice.get("logprobs"),
        tool_calls=message.get("tool_calls") or None,
        # ChatCompletionResponseChoice: ``token_ids`` in 0.5.17, ``response_token_ids`` from
        # 0.5.18 (both only with return_token_ids and stream=false).
        output_ids=_ids(choice.get("response_token_ids", choice.get("token_ids"))),
    )


def effective_cap(loads: dict[str, Any] | None, server_info: dict[str, Any] | None) -> int | None:
    """The running cap the scheduler applies, not the CLI value (``Scheduler.get_internal_state``).

    Order: ``/v1/loads`` ``loads[*].max_running_requests`` (summed over DP ranks), then
    ``/server_info`` ``internal_states[*].effective_max_running_requests_per_dp``.
    """
    ranks = (loads or {}).get("loads") or []
    caps = [r.get("max_running_requests") for r in ranks if r.get("max_running_requests")]
    if caps:
        return int(sum(caps))
    states = (server_info or {}).get("internal_states") or []
    caps = [s.get("effective_max_running_requests_per_dp") for s in states]
    caps = [c for c in caps if c]
    return int(sum(caps)) if caps else None


KEEPALIVE_S = 4.0


class EngineClient:
    """Async client for one engine; one instance per event loop (the session is made on first
    use, inside the loop)."""

    def __init__(self, base_url: str, timeout_s: float, max_connections: int) -> None:
        self.base_url = base_url
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=5.0)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                self.base_url,
                timeout=self._timeout,
                # SGLang's uvicorn closes idle connections after 5 s: never reuse one that old.
                connector=aiohttp.TCPConnector(limit=self._max_connections,
                                               keepalive_timeout=KEEPALIVE_S),
            )
        return self._session

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        start = time.monotonic()
        try:
            async with self._http().post(path, data=orjson.dumps(body),
                                         headers={"content-type": "application/json"}) as resp:
                status, content = resp.status, await resp.read()
        except TimeoutError as exc:
            raise EngineUnavailable(f"request to {self.base_url}{path} timed out") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"{self.base_url}{path}: {type(exc).__name__}") from exc
        if status == 400 or status == 422:
            text = content[:300].decode(errors="replace")
            raise PromptRejected(f"{ENGINE_REJECTED} {text}")
        if status == 500:
            text = content[:200].decode(errors="replace").strip()
            raise PromptFailed(
                f"engine answered HTTP 500 to this prompt ({text!r}); SGLang answers a bare 500 "
                "to a sampling key SamplingParams does not take"
            )
        if status != 200:
            raise EngineUnavailable(f"{self.base_url}{path}: HTTP {status}")
        return orjson.loads(content), time.monotonic() - start

    async def complete(
        self, prompt: str | None, messages: list[Any] | None, sampling: Sampling
    ) -> Completion:
        """Generate one completion for a plain prompt or a chat conversation."""
        messages = chat_messages(prompt, messages, sampling)
        if messages is not None:
            data, latency = await self._post("/v1/chat/completions", chat_body(messages, sampling))
            return parse_chat(data, latency)
        data, latency = await self._post("/generate", _generate_body(prompt or "", sampling))
        return parse_generate(data, latency)

    async def prefill(
        self, prompt: str | None, messages: list[Any] | None, sampling: Sampling
    ) -> None:
        """Prefill a prompt once, generating nothing, so that the requests for its samples
        find it in the radix cache: what SGLang's parallel sampling does before it sends the
        ``n`` copies (``TokenizerManager._handle_batch_request``: the prompt with
        ``max_new_tokens = 0``). The chat route takes ``max_tokens = 1`` (its request model
        refuses 0, ``validate_max_tokens_positive``); its one token is thrown away."""
        messages = chat_messages(prompt, messages, sampling)
        if messages is not None:
            body = chat_body(messages, sampling)
            body["max_tokens"] = 1
            body.pop("max_completion_tokens", None)
            await self._post("/v1/chat/completions", body)
            return
        body = _generate_body(prompt or "", sampling)
        body["sampling_params"]["max_new_tokens"] = 0
        body.pop("return_logprob", None)
        body.pop("top_logprobs_num", None)
        await self._post("/generate", body)

    async def _get(self, path: str, timeout_s: float) -> tuple[int, bytes] | None:
        """(status, body) of one GET, or None when the engine cannot be reached in time."""
        try:
            async with self._http().get(
                path, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError):
            return None

    async def healthy(self, timeout_s: float = 20.0) -> bool:
        """One GET /health probe (SGLang's own health generation gives up after 20 s)."""
        got = await self._get("/health", timeout_s)
        return got is not None and got[0] == 200

    async def _get_json(self, path: str) -> dict[str, Any] | None:
        got = await self._get(path, 10.0)
        if got is None or got[0] != 200:
            return None
        try:
            return orjson.loads(got[1])
        except orjson.JSONDecodeError:
            return None

    async def running_cap(self) -> int | None:
        """The engine's effective running cap (None when it cannot be read)."""
        loads = await self._get_json("/v1/loads")
        info = None if effective_cap(loads, None) else await self._get_json("/server_info")
        return effective_cap(loads, info)
