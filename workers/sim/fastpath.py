"""A thin ASGI layer that serves the hot JSON endpoints without Starlette's per-request stack.

The generation endpoints are what a benchmark hammers (thousands of tiny requests per second on
a 2-core box); routing, middleware and Request/Response objects would cost more than the
simulated engine itself. Everything else falls through to the Starlette app unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from workers.sim.api import JsonHandler, PlainText

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def read_body(receive: Receive) -> bytes:
    """Collect the whole request body from ASGI ``http.request`` messages."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


class FastPath:
    """Serve POSTs to ``handlers``' paths directly; pass everything else to ``app``."""

    def __init__(self, app: ASGIApp, handlers: dict[str, JsonHandler]) -> None:
        self.app = app
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point."""
        handler = self.handlers.get(scope.get("path", "")) if scope["type"] == "http" else None
        if handler is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        status, data = await handler(await read_body(receive))
        plain = isinstance(data, PlainText)
        body = str(data).encode() if plain else orjson.dumps(data)
        kind = b"text/plain; charset=utf-8" if plain else b"application/json"
        headers = [
            (b"content-type", kind),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
