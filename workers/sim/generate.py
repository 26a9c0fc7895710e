"""SGLang's native /generate on the simulated scheduler (``srt/entrypoints/http_server.py``
``generate_request``; the meta_info of ``TokenizerManager._handle_batch_output``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from starlette.routing import Route

from workers.sim.answers import plain_text
from workers.sim.api import (
    INTERNAL_ERROR,
    NOT_READY,
    JsonHandler,
    as_list,
    endpoint,
    error_payload,
    parse_json,
    text_tokens,
)
from workers.sim.engine import SimRequest
from workers.sim.report import log
from workers.sim.state import SimState, Uncaught, make_request
from workers.sim.textgen import count_text_tokens, filler_ids, token_logprobs


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
        return [(len(x), "", str(x), _token_ids(x)) for x in ids], True
    if isinstance(ids, list) and ids:
        return [(len(ids), "", str(ids), _token_ids(ids))], False
    raise ValueError("Either text or input_ids should be provided.")


def _token_ids(ids: list[Any]) -> list[int]:
    """The ids as sent; anything but integers is a 400. Real SGLang 0.5.11 answered 400 to a
    body whose ``input_ids`` were strings (H200, 2026-12-03): ``GenerateReqInput.
    _determine_batch_size`` takes a list whose first entry is not an int for a batch, whose
    entries must then be lists of ids. A list that starts with an int and holds a string
    further on is refused here too, stricter than SGLang (which fails it later)."""
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("input_ids must be a list of token ids (integers).")
    return ids


def build_generate(state: SimState, body: dict[str, Any]) -> tuple[list[SimRequest], bool]:
    """Validated SimRequests of a /generate body (ValueError -> 400)."""
    prompts, batch = _prompts(body)
    params = as_list(body.get("sampling_params") or {}, len(prompts))
    rids = as_list(body.get("rid"), len(prompts))
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


def prefill_requests(state: SimState, body: dict[str, Any]) -> list[SimRequest]:
    """One ``max_new_tokens = 0`` request per prompt of an ``n > 1`` body: what SGLang sends
    to cache the common prefix before the copies (``TokenizerManager._handle_batch_request``)."""
    prompts, _ = _prompts(body)
    params = as_list(body.get("sampling_params") or {}, len(prompts))
    return [make_request(state, n, {**(p or {}), "n": 1, "max_new_tokens": 0}, text, None,
                         key, ids) for (n, text, key, ids), p in zip(prompts, params, strict=True)]


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
    on = as_list(body.get("return_logprob") or False, count)
    top = as_list(body.get("top_logprobs_num") or 0, count)
    start = as_list(body.get("logprob_start_len", -1), count)
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
    text = req.json_text if req.json_text is not None else plain_text(text_tokens(req), req.rid)
    return {"text": text, "output_ids": ids, "meta_info": meta}


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
        if len(reqs) > len(_prompts(body)[0]):
            # n > 1: TokenizerManager._handle_batch_request first sends each prompt with
            # max_new_tokens = 0 and waits for it, so its n copies hit the radix cache.
            await asyncio.gather(*(state.engine.submit(w) for w in prefill_requests(
                state, body)))
        done = await asyncio.gather(*(state.engine.submit(r) for r in reqs))
        asks = logprob_asks(body, len(done))
        items = [generate_result(state, r, ask) for r, ask in zip(done, asks, strict=True)]
        return 200, items if batch else items[0]

    return generate


def generate_routes(state: SimState) -> list[Route]:
    """The /generate route (POST and PUT, as SGLang's)."""
    return [Route("/generate", endpoint(generate_handler(state)), methods=["POST", "PUT"])]
