"""Rows judged by their form, not their length: tool calls and structured output.

A row whose ``tool_calls`` is set is a tool-call row: it is good when its calls are well
formed (a non-empty JSON list of calls, each naming a function and giving its ``arguments`` as
a JSON object, or JSON text of one: ``OpenAIServingChat._process_tool_calls``'s shape). A row
asked for structured output (``json_schema``, ``regex``, ``ebnf``, or ``response_format`` of
type ``json_schema`` / ``json_object``; the row's own parameters, else the job's) is good when
its answer parses as JSON valid for the schema, or matches the regex or the grammar in full.

An EBNF grammar is matched by turning it into a regular expression (SGLang's GBNF: rules
``name ::= ...``, string literals, character classes, groups, ``|``, ``* + ?`` and
``{m,n}``); a grammar that refers to itself has no such expression and is judged by its
answer not being blank. So is a regex that Python's ``re`` cannot compile.
"""

from __future__ import annotations

import functools
import re
from typing import Any, NamedTuple

import orjson

GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "response_format")


class Constraint(NamedTuple):
    """What a structured-output row was asked for: ``kind`` (json_schema, json_object, regex,
    ebnf) and its ``spec`` (the schema as JSON text, the pattern, the grammar; "" for
    json_object)."""

    kind: str
    spec: str


def constraint_of(params: dict[str, Any] | None) -> Constraint | None:
    """The structured output ``params`` (a row's or job's request parameters) ask for."""
    if not params:
        return None
    for key in ("json_schema", "regex", "ebnf"):
        value = params.get(key)
        if value is not None:
            spec = value if isinstance(value, str) else orjson.dumps(value).decode()
            return Constraint(key, spec)
    fmt = params.get("response_format")
    if isinstance(fmt, dict):
        if fmt.get("type") == "json_object":
            return Constraint("json_object", "")
        if fmt.get("type") == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            return Constraint("json_schema", orjson.dumps(schema).decode()
                              if schema is not None else "")
    return None


def tool_calls_ok(text: str) -> bool:
    """Whether a row's ``tool_calls`` (JSON text) are well formed (see the module docstring)."""
    try:
        calls = orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(calls, list) or not calls:
        return False
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            return False
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = orjson.loads(args)
            except orjson.JSONDecodeError:
                return False
        if not isinstance(args, dict):
            return False
    return True


def form_ok(constraint: Constraint, answer: str) -> bool:
    """Whether ``answer`` is what ``constraint`` asked for."""
    if constraint.kind in ("json_schema", "json_object"):
        try:
            doc = orjson.loads(answer)
        except orjson.JSONDecodeError:
            return False
        if constraint.kind == "json_object":
            return isinstance(doc, dict)
        validator = _validator(constraint.spec)
        return validator is None or validator.is_valid(doc)
    pattern = _regex(constraint.spec) if constraint.kind == "regex" else _ebnf(constraint.spec)
    if pattern is None:
        return bool(answer.strip())
    return pattern.fullmatch(answer) is not None


@functools.lru_cache(maxsize=64)
def _validator(schema_text: str) -> Any:
    """A validator of the schema (None: no schema, or one jsonschema cannot read)."""
    if not schema_text:
        return None
    try:
        import jsonschema
        from jsonschema.exceptions import SchemaError
    except ImportError:  # a worker image without it: the answer must still parse
        return None
    try:
        schema = orjson.loads(schema_text)
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        return cls(schema)
    except (orjson.JSONDecodeError, SchemaError, TypeError):
        return None


@functools.lru_cache(maxsize=64)
def _regex(pattern: str) -> re.Pattern[str] | None:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error:
        return None


# --- EBNF (GBNF) as a regular expression ----------------------------------------------------
_TOKEN = re.compile(r'''\s+|\#[^\n]*|"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z_][\w-]*
                        |::=|\{\d*(?:,\d*)?\}|[()|*+?]''', re.VERBOSE)


class _Recursive(Exception):
    """The grammar refers to itself: no regular expression matches it."""


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"unexpected {text[pos]!r}")
        tok, pos = m.group(0), m.end()
        if not tok.isspace() and not tok.startswith("#"):
            out.append(tok)
    return out


def _rules(tokens: list[str]) -> dict[str, list[str]]:
    """name -> its tokens (a rule runs to the next ``name ::=``)."""
    rules: dict[str, list[str]] = {}
    name = None
    for i, tok in enumerate(tokens):
        if i + 1 < len(tokens) and tokens[i + 1] == "::=":
            name = tok
            rules[name] = []
        elif tok != "::=" and name is not None:
            rules[name].append(tok)
    return rules


def _literal(tok: str) -> str:
    return re.escape(orjson.loads(tok)) if "\\" in tok else re.escape(tok[1:-1])


def _expr(rules: dict[str, list[str]], name: str, stack: tuple[str, ...]) -> str:
    if name in stack:
        raise _Recursive(name)
    alts, cur, depth = [], "", 0
    for tok in rules[name]:
        if tok == "|" and not depth:
            alts.append(cur)
            cur = ""
        elif tok in ("|", "(", ")"):
            depth += {"(": 1, ")": -1}.get(tok, 0)
            cur += "(?:" if tok == "(" else tok
        elif tok in ("*", "+", "?") or tok.startswith("{"):
            cur += tok
        elif tok.startswith('"'):
            cur += f"(?:{_literal(tok)})"
        elif tok.startswith("["):
            cur += tok
        elif tok in rules:
            cur += f"(?:{_expr(rules, tok, (*stack, name))})"
        else:
            raise ValueError(f"no rule {tok!r}")
    alts.append(cur)
    return "|".join(f"(?:{a})" for a in alts)


@functools.lru_cache(maxsize=64)
def _ebnf(grammar: str) -> re.Pattern[str] | None:
    """The grammar's ``root`` as a compiled regex (None: recursive, or not read)."""
    try:
        rules = _rules(_tokens(grammar))
        return re.compile(_expr(rules, "root", ()), re.DOTALL) if "root" in rules else None
    except (_Recursive, ValueError, re.error, orjson.JSONDecodeError):
        return None
