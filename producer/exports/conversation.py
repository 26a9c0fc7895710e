"""One data-set row as the conversation a drafter trainer reads (SpecForge's shape).

SpecForge (``specforge/data/parse.py``) reads ``conversations: [{role, content,
reasoning_content?, tool_calls?}]`` and a row's ``tools``; its ``GeneralParser`` keeps
``role``, ``content`` and ``tool_calls`` of each message, its ``ThinkingParser`` also
``reasoning_content``. The conversation here is the messages the engine was sent (the job's
``--system-prompt`` first where the row had no system message of its own, as the worker sent
it; a plain prompt as one user message; :mod:`producer.exports.sent`), then the assistant turn
the engine answered.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import orjson

from producer.exports.sent import Sent

Message = dict[str, Any]


def _json(value: Any) -> Any:
    """A JSON-text value decoded (a list or dict kept as it is; bad text is kept as text)."""
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def conversation(sent: Sent, rec: dict[str, Any]) -> list[Message]:
    """The messages the engine was sent for ``rec`` (every field of each, as the request
    carried it; a plain prompt as one user message), then the generated assistant turn."""
    messages = (copy.deepcopy(sent.messages) if sent.messages is not None
                else [{"role": "user", "content": sent.prompt or ""}])
    return [*messages, assistant_turn(rec)]


def assistant_turn(rec: dict[str, Any]) -> Message:
    """The engine's answer as an assistant message: ``content`` and ``reasoning_content``
    apart, ``tool_calls`` (OpenAI's shape, as the engine's parser gave them) when there are."""
    turn: Message = {"role": "assistant", "content": rec.get("completion") or ""}
    if rec.get("reasoning") is not None:
        turn["reasoning_content"] = rec["reasoning"]
    if rec.get("tool_calls"):
        turn["tool_calls"] = _json(rec["tool_calls"])
    return turn


def row_tools(rec: dict[str, Any]) -> list[Any] | None:
    """The row's ``tools`` (an input column kept with ``--keep-columns tools``), or None."""
    tools = _json(rec.get("tools"))
    return tools if isinstance(tools, list) and tools else None


def content_id(messages: list[Message], tools: list[Any] | None, sample: int,
               turn: Message | None = None) -> str:
    """A stable content hash over the input (messages and tools) and the sample (its index
    and, when given, the answer): the same conversation gives the same id in every export."""
    doc = {"messages": messages, "tools": tools, "sample": sample, "answer": turn}
    return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]
