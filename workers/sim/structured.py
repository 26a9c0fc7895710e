"""Tools and structured output on the simulator, answered and refused as SGLang does.

Refusals, each a 400 before anything is generated:

- ``OpenAIServingChat._validate_request`` (``srt/entrypoints/openai/serving_chat.py``):
  ``tool_choice`` "required" without tools, a named tool choice without tools or naming a tool
  that is not in them, a tool whose ``function.parameters`` is not a valid JSON schema
  (``Draft202012Validator.check_schema``; checked when ``jsonschema`` is installed).
- ``ChatCompletionRequest`` (``srt/entrypoints/openai/protocol.py``, pydantic): ``tools`` that
  is not a list, a ``tool_choice`` that is neither a string nor an object, a ``response_format``
  of type ``json_schema`` without its schema.
- ``SamplingParams.verify``: more than one of ``json_schema``, ``regex``, ``ebnf``.
- ``Scheduler.move_ready_grammar_requests``: a grammar that does not compile is aborted with
  status 400 and "Invalid grammar request" (a json_schema that is not JSON, a regex that does
  not compile).

Answers: with a JSON schema (``/generate``'s ``json_schema``, the chat route's
``response_format``) the text is a JSON document valid for the schema (the simplest instance:
the sim has no model). A regex or EBNF grammar is checked but the filler text is not made to
match it. With tools and ``tool_choice`` other than "none", an engine launched with
``--tool-call-parser`` answers a tool call (always for "required" or a named tool; for "auto",
for about half the prompts, drawn from the prompt) as ``OpenAIServingChat._process_tool_calls``
returns it: ``message.tool_calls`` with JSON ``arguments``, content null, finish reason
``tool_calls``. Without the parser the tools only reach the chat template and the answer is
text, ``tool_calls`` null, as in SGLang.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import orjson

from workers.engine.sampling import GRAMMARS  # SamplingParams.verify: one per request


def check_grammar(params: dict[str, Any]) -> None:
    """ValueError (answered 400) for a grammar SGLang refuses (see the module docstring)."""
    given = [g for g in GRAMMARS if params.get(g) is not None]
    if len(given) > 1:
        raise ValueError("Only one of regex, json_schema, or ebnf can be set for a request.")
    if params.get("json_schema") is not None:
        try:
            schema = orjson.loads(params["json_schema"])
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"Invalid grammar request: json_schema: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("Invalid grammar request: json_schema must be a JSON object")
    if params.get("regex") is not None:
        try:
            re.compile(params["regex"])
        except (re.error, TypeError) as exc:
            raise ValueError(f"Invalid grammar request: regex: {exc}") from None


_SCALARS: dict[str, Any] = {
    "string": lambda s: "x" * int(s.get("minLength") or 1),
    "integer": lambda s: int(s.get("minimum") or 0),
    "number": lambda s: float(s.get("minimum") or 0),
    "boolean": lambda s: False,
    "null": lambda s: None,
}


def _kind(schema: dict[str, Any]) -> str | None:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None and "properties" in schema:
        return "object"
    return kind


def instance(schema: Any, depth: int = 0) -> Any:
    """The simplest JSON value valid for ``schema`` (required properties only)."""
    if not isinstance(schema, dict) or depth > 8:
        return {}
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return instance(schema[key][0], depth + 1)
    kind = _kind(schema)
    if kind == "object":
        props = schema.get("properties") or {}
        return {k: instance(props.get(k, {}), depth + 1) for k in schema.get("required") or []}
    if kind == "array":
        return [instance(schema.get("items") or {}, depth + 1)
                for _ in range(int(schema.get("minItems") or 0))]
    return _SCALARS[kind](schema) if kind in _SCALARS else {}


def response_schema(body: dict[str, Any]) -> Any | None:
    """The JSON schema a chat body's ``response_format`` asks for (None: free text);
    ValueError for a json_schema format without its schema (pydantic refuses it)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                            "json_schema", "structural_tag"):
        raise ValueError("response_format: Input should be a valid response format "
                         "(text, json_object, json_schema or structural_tag)")
    if fmt["type"] == "json_object":
        return {"type": "object"}
    if fmt["type"] != "json_schema":
        return None
    inner = fmt.get("json_schema")
    schema = inner.get("schema") if isinstance(inner, dict) else None
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema: Field required")
    return schema


def _tool_name(tool: Any) -> str | None:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return fn.get("name") if isinstance(fn, dict) else None


def _check_parameters(i: int, params: Any) -> None:
    """``Draft202012Validator.check_schema`` of one tool's parameters (400 when invalid)."""
    try:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError
    except ImportError:  # the full check needs jsonschema, as SGLang's does
        if not isinstance(params, dict | bool):
            raise ValueError(f"Tool {i} function has invalid 'parameters' schema: "
                             f"{params!r} is not of type 'object', 'boolean'") from None
        return
    try:
        Draft202012Validator.check_schema(params)
    except SchemaError as exc:
        raise ValueError(f"Tool {i} function has invalid 'parameters' schema: "
                         f"{exc.message}") from None


def validate_tools(body: dict[str, Any]) -> None:
    """ValueError (400) as ``ChatCompletionRequest`` and ``OpenAIServingChat._validate_request``
    refuse a request's tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools: Input should be a valid list")
    if choice is not None and not isinstance(choice, str | dict):
        raise ValueError("tool_choice: Input should be a valid string or object")
    if any(_tool_name(t) is None for t in tools or []):
        raise ValueError("tools.function.name: Field required")
    if isinstance(choice, str) and choice.lower() == "required" and not tools:
        raise ValueError("Tools cannot be empty if tool choice is set to required.")
    if isinstance(choice, dict):
        if not tools:
            raise ValueError("Tools cannot be empty if tool choice is set to a specific tool.")
        name = _tool_name(choice)
        if not any(_tool_name(t) == name for t in tools):
            raise ValueError(f"Tool '{name}' not found in tools list.")
    for i, tool in enumerate(tools or []):
        if tool["function"].get("parameters") is not None:
            _check_parameters(i, tool["function"]["parameters"])


def tool_calls(body: dict[str, Any], identity: str, parser: str | None
               ) -> list[dict[str, Any]] | None:
    """The tool calls the sim answers for a chat body (None: a text answer)."""
    tools, choice = body.get("tools") or [], body.get("tool_choice", "auto")
    if not tools or not parser or choice == "none":
        return None
    digest = hashlib.blake2b(identity.encode(), digest_size=8).digest()
    if isinstance(choice, dict):
        name = _tool_name(choice)
        tool = next(t for t in tools if _tool_name(t) == name)
    elif choice == "required" or digest[0] % 2 == 0:
        tool = tools[digest[1] % len(tools)]
    else:
        return None
    args = instance(tool["function"].get("parameters") or {"type": "object"})
    return [{"id": f"call_{digest.hex()}", "index": 0, "type": "function",
             "function": {"name": _tool_name(tool), "arguments": orjson.dumps(args).decode()}}]
