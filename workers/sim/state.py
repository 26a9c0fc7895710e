"""The simulator's shared state and request building (validation, token counts, fault markers).

Validation follows ``TokenizerManager._validate_one_request`` and ``SamplingParams.verify`` (the
messages are SGLang's as far as recalled; their shape, ``{"error": {"message": ...}}`` with 400,
is SGLang's). ``max_new_tokens`` is then clamped like ``Scheduler.init_req_max_new_tokens``.

Fault injection (sim only, for tests): a prompt containing ``__SIM_CRASH__`` kills the whole sim
process (``os._exit(1)``) when the request is admitted to the running batch, as an engine crash on
a poison prompt would; a prompt containing ``__SIM_HANG__`` is admitted and never advances; a
prompt containing ``__SIM_ERROR__`` gets the bare HTTP 500 of an exception no handler catches.
"""

from __future__ import annotations

import argparse
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from workers.engine.capacity import (
    CapacityPlan,
    EngineFlags,
    ModelShape,
    cli_max_running_requests,
    resolved_mamba_strategy,
    speculative_params,
)
from workers.engine.server_args import reserved_tokens
from workers.engine.versions import DEFAULT_VERSION
from workers.sim.engine import SimEngine, SimRequest, clamp_max_new_tokens
from workers.sim.radix import prefix_keys
from workers.sim.report import Reporter, SimMetrics
from workers.sim.structured import check_grammar, instance
from workers.sim.textgen import OutputLengths

CRASH_MARKER = "__SIM_CRASH__"
HANG_MARKER = "__SIM_HANG__"
ERROR_MARKER = "__SIM_ERROR__"


@dataclass
class SimState:
    """Everything the HTTP handlers need."""

    args: argparse.Namespace
    shape: ModelShape
    flags: EngineFlags
    plan: CapacityPlan
    engine: SimEngine
    reporter: Reporter
    metrics: SimMetrics | None
    lengths: OutputLengths
    speed: float
    version: str = DEFAULT_VERSION
    ready: bool = False
    started_at: float = field(default_factory=time.time)
    server_args: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        """``--served-model-name``, defaulting to the model path."""
        return self.args.served_model_name or self.args.model_path

    @property
    def speculative(self) -> bool:
        """Whether speculative decoding is on."""
        return self.plan.num_draft_tokens > 0


def resolved_server_args(
    args: argparse.Namespace, flags: EngineFlags, plan: CapacityPlan
) -> dict[str, Any]:
    """ServerArgs after ``__post_init__``, as the top level of /server_info shows them."""
    resolved = dict(vars(args))
    # --collect-tokens-histogram is a DeprecatedAction in 0.5.11: parsed, never a ServerArgs field.
    resolved.pop("collect_tokens_histogram", None)
    resolved.update(
        served_model_name=args.served_model_name or args.model_path,
        tokenizer_path=args.tokenizer_path or args.model_path,
        mem_fraction_static=plan.mem_fraction_static,
        chunked_prefill_size=plan.chunked_prefill_size,
        cuda_graph_max_bs=plan.cuda_graph_max_bs,
        max_running_requests=cli_max_running_requests(flags),  # CLI value or 48, not the cap
        mamba_scheduler_strategy=resolved_mamba_strategy(flags),
        disable_overlap_schedule=not plan.overlap_schedule,
        context_length=args.context_length,
        page_size=args.page_size or 1,
    )
    if flags.speculative_algorithm is not None:
        steps, topk, drafts = speculative_params(flags)
        algo = "EAGLE" if flags.speculative_algorithm == "NEXTN" else flags.speculative_algorithm
        resolved.update(
            speculative_algorithm=algo,
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=drafts,
        )
    return resolved


# The keywords ``SamplingParams.__init__`` takes (srt/sampling/sampling_params.py, 0.5.10.post1
# and 0.5.11; the same names are the msgspec fields of later releases). The tokenizer manager
# builds ``SamplingParams(**{**preferred_sampling_params, **sampling_params})``
# (``TokenizerManager._tokenize_one_request``), so any other key is a TypeError.
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
        "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
        "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
        "custom_params", "stream_interval", "logit_bias", "sampling_seed",
    }
)


class Uncaught(TypeError):
    """An error SGLang's ``/generate`` handler does not catch (it catches only ValueError)."""


def _check_keys(params: dict[str, Any]) -> None:
    """Raise the TypeError ``SamplingParams(**params)`` raises on an unexpected keyword."""
    for key in params:
        if key not in SAMPLING_KEYS:
            raise Uncaught(f"SamplingParams.__init__() got an unexpected keyword argument '{key}'")


def _check_sampling(params: dict[str, Any]) -> int | None:
    """``SamplingParams.verify``: raise ValueError on bad values; return max_new_tokens."""
    _check_keys(params)
    max_new = params.get("max_new_tokens", 128)
    if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool)):
        raise ValueError(f"max_new_tokens must be an integer, got {max_new!r}.")
    if max_new is not None and max_new < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {max_new}.")
    temperature = params.get("temperature")
    if temperature is not None and float(temperature) < 0:
        raise ValueError(f"temperature must be non-negative, got {temperature}.")
    top_p = params.get("top_p")
    if top_p is not None and not 0 < float(top_p) <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    top_k = params.get("top_k")
    if top_k is not None and top_k != -1 and int(top_k) < 1:
        raise ValueError(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    return max_new


def _check_context(input_len: int, max_new: int | None, context_len: int, reserved: int) -> None:
    """``TokenizerManager._validate_one_request``: the request must fit the context.

    The input counts the reserved speculative tokens; the input alone must be shorter than the
    context, and input plus ``max_new_tokens`` must not exceed it.
    """
    counted = input_len + reserved
    if counted >= context_len:
        raise ValueError(
            f"The input ({counted} tokens) is longer than the model's context length "
            f"({context_len} tokens)."
        )
    if max_new is not None and counted + max_new > context_len:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {context_len} "
            f"tokens. You requested a total of {counted + max_new} tokens: {counted} tokens "
            f"from the input messages and {max_new} tokens for the completion. Please reduce the "
            "number of tokens in the input messages or the completion to fit within the limit."
        )


def _check_scheduler_length(input_len: int, max_req_input_len: int) -> None:
    """``validate_input_length`` (managers/utils.py), called by
    ``Scheduler.handle_generate_request``: ``len(origin_input_ids) >= max_req_input_len`` is
    refused, where ``max_req_input_len = min(context_len - 1, pool - 1) - 5``
    (``TpModelWorker.__init__``). The request is aborted with status 400
    (``Req.set_finish_with_abort``) and ``TokenizerManager._wait_one_response`` raises the
    message as a ValueError. It bites after the tokenizer-side check: with MTP (4 reserved) and
    context 8192, 8187 input ids pass ``_validate_one_request`` and are refused here."""
    if input_len >= max_req_input_len:
        raise ValueError(
            f"Input length ({input_len} tokens) exceeds the maximum allowed length "
            f"({max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
        )


def make_request(
    state: SimState,
    input_len: int,
    params: dict[str, Any],
    text: str = "",
    rid: str | None = None,
    key: str | None = None,
    ids: list[int] | None = None,
) -> SimRequest:
    """Validate one prompt and build its SimRequest (raises ValueError -> HTTP 400).

    ``key`` identifies the prompt for its output length (default: ``text``); an unknown sampling
    key (or the error marker) raises :class:`Uncaught`, which /generate answers with a bare 500.
    """
    max_new = _check_sampling(params)
    check_grammar(params)
    if ERROR_MARKER in text:
        raise Uncaught("sim fault injection: __SIM_ERROR__")
    plan = state.plan
    if state.args.allow_auto_truncate:
        input_len = min(input_len, plan.max_req_input_len)
    else:
        _check_context(input_len, max_new, plan.context_len, reserved_tokens(state.flags))
        _check_scheduler_length(input_len, plan.max_req_input_len)
    clamped = clamp_max_new_tokens(max_new, input_len, plan.max_req_len)
    identity = text if key is None else key
    if params.get("sampling_seed") is not None:
        # Another seed draws another answer (SGLang's sampler seeds each request's draw with
        # its sampling_seed): the samples of one prompt differ, a rerun repeats them.
        identity = f"{identity}\0seed={params['sampling_seed']}"
    drawn = clamped + 1 if params.get("ignore_eos") else state.lengths.draw(identity)
    return SimRequest(
        rid=rid or uuid.uuid4().hex,
        input_len=input_len,
        max_new_tokens=clamped,
        drawn_len=drawn,
        prefix=prefix_keys(text, ids),
        prompt_ids=ids,
        crash=CRASH_MARKER in text,
        hang=HANG_MARKER in text,
        json_text=None if params.get("json_schema") is None
        else orjson.dumps(instance(orjson.loads(params["json_schema"]))).decode(),
    )


def probe_request() -> SimRequest:
    """The 1-token health probe (rid prefix HEALTH_CHECK, no metrics)."""
    return SimRequest(
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        input_len=1,
        max_new_tokens=1,
        drawn_len=1,
        internal=True,
    )
