"""The real SGLang 0.5.11 captures under tests/fixtures/sglang/0.5.11/real-h200/, as data.

Each ``NN_name.txt`` is one verbatim HTTP exchange: ``REQUEST: METHOD PATH``, an optional
``REQUEST BODY: {json}`` line, a blank line, ``STATUS: code reason   (took …)``, the response
headers, a blank line and the body.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

REAL = Path(__file__).resolve().parent / "fixtures" / "sglang" / "0.5.11" / "real-h200"
HYBRID = ("big80", "big200", "big200_40")
CAPTURES = (*HYBRID, "dense")
_STATUS = re.compile(r"^STATUS: (\d+) ")
_TRUNCATED = "...[truncated, "


@dataclass(frozen=True)
class Exchange:
    """One captured request and the real engine's answer."""

    name: str
    method: str
    path: str
    request: dict[str, Any] | None  # None when the capture truncated a long body
    status: int
    headers: dict[str, str]
    body: str
    request_line: str = ""  # the ``REQUEST BODY:`` text as captured (maybe truncated)

    def json(self) -> Any:
        """The response body as JSON."""
        return json.loads(self.body)

    @property
    def streamed(self) -> bool:
        """Whether the answer is a server-sent event stream."""
        return self.headers.get("content-type", "").startswith("text/event-stream")

    def events(self) -> list[Any]:
        """The ``data:`` payloads of a stream (JSON, or the literal ``[DONE]``)."""
        out: list[Any] = []
        for line in self.body.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
        return out


def parse_exchange(path: Path) -> Exchange:
    """Read one ``NN_name.txt`` capture."""
    lines = path.read_text().split("\n")
    method, target = lines[0].removeprefix("REQUEST: ").split(" ", 1)
    request, raw = None, ""
    if lines[1].startswith("REQUEST BODY: "):
        raw = lines[1].removeprefix("REQUEST BODY: ")
        request = None if _TRUNCATED in raw else json.loads(raw)
    at = next(i for i, line in enumerate(lines) if _STATUS.match(line))
    status = int(_STATUS.match(lines[at]).group(1))  # type: ignore[union-attr]
    headers: dict[str, str] = {}
    end = at + 1
    while end < len(lines) and lines[end]:
        key, _, value = lines[end].partition(": ")
        headers[key.lower()] = value
        end += 1
    body = "\n".join(lines[end + 1:]).rstrip("\n")
    return Exchange(path.stem, method, target, request, status, headers, body, raw)


def rebuilt_request(x: Exchange) -> dict[str, Any]:
    """The full body of a ``lenN_maxM`` exchange whose capture truncated it.

    The capture script sent ``input_ids = [100 + i % 500 for i in range(N)]``; the rebuilt
    body is checked against the captured head and tail, so a wrong guess fails loudly.
    """
    if x.request is not None:
        return x.request
    head, _, rest = x.request_line.partition(" " + _TRUNCATED)
    size, _, tail = rest.partition(" bytes]... ")
    if head.startswith('{"text": "'):
        # A long text: its words were random, so any words of the same length stand in.
        start = json.loads(head + '"}')["text"]
        end = json.loads('{"text": "' + tail)
        filler = ("word " * (int(size) // 5 + 1))[: int(size) - len(head) - len(tail)]
        return {**end, "text": start + filler + end["text"]}
    match = re.search(r"len(\d+)_max(\d+)$", x.name)
    assert match, f"{x.name}: truncated body that cannot be rebuilt"
    n, max_new = int(match.group(1)), int(match.group(2))
    body = {"input_ids": [100 + i % 500 for i in range(n)],
            "sampling_params": {"max_new_tokens": max_new}}
    full = json.dumps(body)
    assert full.startswith(head) and full.endswith(tail), f"{x.name}: rebuilt body differs"
    return body


@cache
def exchanges(capture: str) -> tuple[Exchange, ...]:
    """Every exchange of one capture, in the order it was sent."""
    return tuple(parse_exchange(p) for p in sorted((REAL / capture).glob("[0-9][0-9]_*.txt")))


def exchange(capture: str, suffix: str) -> Exchange:
    """The exchange of ``capture`` whose name ends with ``suffix`` (``len8187_max1``)."""
    found = [x for x in exchanges(capture) if x.name.endswith(suffix)]
    assert len(found) == 1, (capture, suffix, [x.name for x in found])
    return found[0]


def text(capture: str, name: str) -> str:
    """A capture's other file (``server.log``, ``load_metrics_t10.txt`` …)."""
    return (REAL / capture / name).read_text()


def samples(capture: str) -> list[dict[str, Any]]:
    """``load_samples.jsonl``: per second, /v1/loads and the ``sglang:`` gauges under load."""
    return [json.loads(line) for line in text(capture, "load_samples.jsonl").splitlines() if line]
