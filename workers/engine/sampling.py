"""The sampling parameters an SGLang engine accepts, and OpenAI's names mapped onto them.

``POST /generate`` builds ``SamplingParams(**sampling_params)`` and calls its ``verify()``
(``srt/managers/tokenizer_manager.py``, ``TokenizerManager._create_tokenized_object``, in
0.5.10.post1 and 0.5.23 alike). The keywords are those of ``SamplingParams.__init__`` in
``srt/sampling/sampling_params.py`` (0.5.10.post1, 0.5.11; 0.5.23 makes it a ``msgspec.Struct``
with the same fields plus ``beam_width`` and ``watermark``). Any other key is a TypeError the
handler does not catch, so the engine answers a bare 500 for every prompt that carries it.
``SAMPLING_PARAMS`` is that keyword list (the keys every version of the supported range
accepts) with the type each value must have, and ``RANGES`` the bounds ``verify()`` enforces.

``/v1/chat/completions`` takes OpenAI's names instead (``ChatCompletionRequest`` in
``srt/entrypoints/openai/protocol.py``; ``to_sampling_params`` maps ``seed`` to
``sampling_seed``, ``max_completion_tokens or max_tokens`` to ``max_new_tokens`` and
``min_tokens`` to ``min_new_tokens``). Staged rows keep their own (OpenAI or SGLang) names;
:func:`translate` and :func:`route_fields` put them in the fields of the route a request takes
(the job's options merged with the row's: :mod:`workers.batch.prompt_sampling`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _strs(v: Any) -> bool:
    return _str(v) or (isinstance(v, list) and all(map(_str, v)))


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(map(_int, v))


def _dict(v: Any) -> bool:
    return isinstance(v, dict)


def _bias(v: Any) -> bool:
    return _dict(v) and all(_num(x) for x in v.values())


def _list(v: Any) -> bool:
    return isinstance(v, list)


def _str_or_dict(v: Any) -> bool:
    return _str(v) or _dict(v)


@dataclass(frozen=True)
class Param:
    """One accepted keyword: its type check, the type in words, whether null is accepted."""

    check: Callable[[Any], bool]
    kind: str
    nullable: bool = False


INT, NUM, BOOL = Param(_int, "an integer"), Param(_num, "a number"), Param(_bool, "true or false")
STRS = Param(_strs, "a string or a list of strings", True)
OPT_STR, OPT_INT = Param(_str, "a string", True), Param(_int, "an integer", True)

# SamplingParams.__init__ keywords (0.5.10.post1). Non-Optional ones are used in __init__ or
# verify() without a None check there, so null is a TypeError (a 500) in that version.
SAMPLING_PARAMS: dict[str, Param] = {
    "max_new_tokens": OPT_INT,
    "stop": STRS,
    "stop_token_ids": Param(_ints, "a list of integers", True),
    "stop_regex": STRS,
    "temperature": NUM,
    "top_p": NUM,
    "top_k": INT,
    "min_p": NUM,
    "frequency_penalty": NUM,
    "presence_penalty": NUM,
    "repetition_penalty": NUM,
    "min_new_tokens": INT,
    "n": INT,
    "json_schema": OPT_STR,
    "regex": OPT_STR,
    "ebnf": OPT_STR,
    "structural_tag": OPT_STR,
    "ignore_eos": BOOL,
    "skip_special_tokens": BOOL,
    "spaces_between_special_tokens": BOOL,
    "no_stop_trim": BOOL,
    "custom_params": Param(_dict, "an object", True),
    "stream_interval": OPT_INT,
    "logit_bias": Param(_bias, "an object of numbers", True),
    "sampling_seed": OPT_INT,
}
# SamplingParams.verify (0.5.10.post1): (low, high, low inclusive, high inclusive).
RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "temperature": (0.0, float("inf"), True, False),
    "top_p": (0.0, 1.0, False, True),
    "min_p": (0.0, 1.0, True, True),
    "frequency_penalty": (-2.0, 2.0, True, True),
    "presence_penalty": (-2.0, 2.0, True, True),
    "repetition_penalty": (0.0, 2.0, False, True),
    "min_new_tokens": (0, float("inf"), True, False),
    "max_new_tokens": (0, float("inf"), True, False),
}
# OpenAI names of the same parameters (protocol.py, ChatCompletionRequest.to_sampling_params).
OPENAI_NAMES = {
    "seed": "sampling_seed",
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
}
# The same, the other way: the names /v1/chat/completions reads.
CHAT_NAMES = {"sampling_seed": "seed", "max_new_tokens": "max_tokens",
              "min_new_tokens": "min_tokens"}
# SamplingParams keywords ChatCompletionRequest has no field for (pydantic ignores them there).
# json_schema is the exception the fleet bridges: on the chat route it becomes the
# response_format that OpenAIServingChat turns back into sampling_params["json_schema"].
NOT_IN_CHAT = frozenset({"structural_tag", "stream_interval",
                         "spaces_between_special_tokens"})
# SamplingParams.verify: at most one grammar per request ("Only one of regex, json_schema, or
# ebnf can be set").
GRAMMARS = ("json_schema", "regex", "ebnf")
# Request-level, not sampling: GenerateReqInput.return_logprob / top_logprobs_num
# (srt/managers/io_struct.py); the chat route's own names are logprobs / top_logprobs.
LOGPROB_KEYS = {"logprobs": "return_logprob", "top_logprobs": "top_logprobs_num"}
# Fields only /v1/chat/completions has (ChatCompletionRequest).
CHAT_ONLY: dict[str, Param] = {
    "chat_template_kwargs": Param(_dict, "an object", True),
    "reasoning_effort": OPT_STR,
    "separate_reasoning": BOOL,
    "response_format": Param(_dict, "an object", True),
    # Tool use (OpenAIServingChat: the tools go to the chat template and the engine's
    # --tool-call-parser parses the answer into message.tool_calls).
    "tools": Param(_list, "a list of tool definitions", True),
    "tool_choice": Param(_str_or_dict, "\"none\", \"auto\", \"required\" or an object", True),
}
# OpenAI metadata that asks nothing of the engine: never sent, counted as dropped.
METADATA = frozenset({"user", "metadata", "store"})


class SamplingError(ValueError):
    """A sampling key the engine would refuse, or a value of the wrong type."""

    def __init__(self, key: str, reason: str, droppable: bool = False) -> None:
        self.key, self.reason, self.droppable = key, reason, droppable
        super().__init__(f"sampling key {key!r} {reason}")


@dataclass
class Translated:
    """One parameter dict in engine terms, split by where each key goes."""

    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keywords
    logprobs: dict[str, Any] = field(default_factory=dict)  # return_logprob, top_logprobs_num
    chat: dict[str, Any] = field(default_factory=dict)  # chat-only request fields
    dropped: list[str] = field(default_factory=list)  # metadata keys, never sent
    samples: int | None = None  # OpenAI ``n``: samples per prompt (never sent as such)


def _check_type(key: str, value: Any, param: Param) -> None:
    if value is None and param.nullable:
        return
    if not param.check(value):
        raise SamplingError(key, f"must be {param.kind}, got {value!r}")


def _check_range(key: str, name: str, value: Any) -> None:
    """The bounds of SamplingParams.verify (a ValueError there, answered 400 per prompt)."""
    if value is None:
        return
    if name == "top_k":
        if value != -1 and value < 1:
            raise SamplingError(key, f"must be -1 (disable) or at least 1, got {value}")
        return
    if name not in RANGES:
        return
    low, high, low_in, high_in = RANGES[name]
    if not ((low <= value if low_in else low < value) and
            (value <= high if high_in else value < high)):
        left, right = "[" if low_in else "(", "]" if high_in else ")"
        raise SamplingError(key, f"must be in {left}{low:g}, {high:g}{right}, got {value}")


def _logprobs(key: str, value: Any, out: Translated) -> None:
    """OpenAI's logprobs (a bool for chat, a count for completions) and top_logprobs."""
    if not (value is None or _int(value) or _bool(value)):
        raise SamplingError(key, f"must be true, false or an integer, got {value!r}")
    if key == "top_logprobs":
        if value:
            out.logprobs["top_logprobs_num"] = value
    elif value:
        out.logprobs["return_logprob"] = True
        if _int(value):
            out.logprobs["top_logprobs_num"] = value


def _sampling_key(key: str, value: Any, chat: bool, out: Translated) -> None:
    name = OPENAI_NAMES.get(key, key)
    if name not in SAMPLING_PARAMS:
        raise SamplingError(key, "is not a sampling parameter SGLang accepts", droppable=True)
    if chat and name in NOT_IN_CHAT:
        raise SamplingError(key, "has no equivalent in a chat request", droppable=True)
    _check_type(key, value, SAMPLING_PARAMS[name])
    _check_range(key, name, value)
    if name == "n":
        # N samples per prompt: the fleet sends each sample as its own request (each with its
        # own seed; workers/dataset/samples.py), so ``n`` itself never reaches the engine.
        if value < 1:
            raise SamplingError(key, f"is {value}: the samples per prompt must be at least 1")
        out.samples = value
        return
    if key == "max_tokens" and out.sampling.get("max_new_tokens") is not None:
        return  # max_completion_tokens wins, as in to_sampling_params
    if name in GRAMMARS and value is not None:
        if other := next((g for g in GRAMMARS if g != name and out.sampling.get(g)), None):
            raise SamplingError(key, f"and {other!r} are both set: SGLang takes one of "
                                     "json_schema, regex or ebnf per request")
        if name == "json_schema" and chat:
            out.chat["response_format"] = _schema_format(key, value)
            return
    out.sampling[name] = value


def _schema_format(key: str, value: str) -> dict[str, Any]:
    """A /generate ``json_schema`` (JSON text) as the chat route's ``response_format``."""
    import orjson

    try:
        schema = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise SamplingError(key, f"is not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise SamplingError(key, "must be a JSON schema object")
    return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}


def _one(key: str, value: Any, chat: bool, out: Translated) -> None:
    if key in METADATA:
        out.dropped.append(key)
    elif key in LOGPROB_KEYS:
        _logprobs(key, value, out)
    elif key in CHAT_ONLY:
        if not chat:
            raise SamplingError(key, "applies to chat requests only (add --chat)",
                                droppable=True)
        _check_type(key, value, CHAT_ONLY[key])
        out.chat[key] = value
    else:
        _sampling_key(key, value, chat, out)


def translate(params: Mapping[str, Any], chat: bool, lenient: bool = False) -> Translated:
    """Split ``params`` (OpenAI or SGLang names) into what the engine takes on this route.

    Raises SamplingError for the first key the engine would refuse; ``lenient`` skips such
    keys instead (rows staged before this check, sent as SGLang would accept them).
    """
    out = Translated()
    # max_completion_tokens first, so it wins over max_tokens whatever the body's order.
    for key in sorted(params, key=lambda k: k != "max_completion_tokens"):
        try:
            _one(key, params[key], chat, out)
        except SamplingError:
            if not lenient:
                raise
    return out


def check_row_params(params: dict[str, Any], chat: bool, drop: bool
                     ) -> tuple[dict[str, Any], list[str]]:
    """Validate a row's parameters at enqueue: (params to stage, keys not sent).

    A key the engine would refuse raises SamplingError, unless ``drop`` is set and the key is
    merely unknown on this route: it is then left out of the staged params and reported.
    Metadata keys (``user``) stay staged (the input fingerprint is over the staged rows) but
    are reported, since they are never sent.
    """
    kept, dropped = dict(params), []
    while True:
        try:
            return kept, dropped + translate(kept, chat).dropped
        except SamplingError as exc:
            if not (drop and exc.droppable):
                raise
            del kept[exc.key]
            dropped.append(exc.key)


def job_params(items: list[str]) -> dict[str, Any]:
    """``--sampling KEY=VALUE`` flags as SGLang keywords (values parsed as JSON when they
    parse, else kept as strings); raises SamplingError naming a refused key."""
    import orjson

    params: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SamplingError(item, "is not KEY=VALUE")
        try:
            params[key] = orjson.loads(raw)
        except orjson.JSONDecodeError:
            params[key] = raw
    t = translate(params, chat=False)
    if t.dropped or t.logprobs:
        key = (t.dropped or list(LOGPROB_KEYS))[0]
        raise SamplingError(key, "is not a sampling parameter")
    return {**t.sampling, **({"n": t.samples} if t.samples is not None else {})}


def route_fields(t: Translated, chat: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(request fields beside the three named ones, /generate top-level fields)."""
    if not chat:
        return t.sampling, t.logprobs or None
    body = {CHAT_NAMES.get(k, k): v for k, v in t.sampling.items()}
    if t.logprobs.get("return_logprob"):
        body["logprobs"] = True
    if "top_logprobs_num" in t.logprobs:
        body["top_logprobs"] = t.logprobs["top_logprobs_num"]
    return {**body, **t.chat}, None
