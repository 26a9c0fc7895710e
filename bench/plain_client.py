"""The baseline: a plain asyncio client that keeps a fixed number of requests in flight per server.

This is what the original run used (docs/workload.md): one async loop per SGLang
server, 48 (later 96) chat requests in flight each, no queue, no durability. Prompts come from
one shared iterator, so no server idles while another still has a backlog. Each in-flight slot
owns one keep-alive HTTP/1.1 connection written with asyncio streams: a client this lean is
never what limits the engines on a two-core machine, so it is the bar the fleet is measured
against (bench/vs_plain.py):

    python -m bench.plain_client prompts.jsonl --server http://127.0.0.1:30000 \\
        --server http://127.0.0.1:30001 --in-flight 96 --max-new-tokens 7000 [--out out.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

CHAT_PATH = b"/v1/chat/completions"


@dataclass
class PlainResult:
    """What one plain run did."""

    in_flight: int
    servers: int
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU during the run
    rows: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second, first request to last response."""
        return self.output_tokens / max(self.seconds, 1e-9)


class Connection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads content-length replies."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        """(status, body) of one POST; a kept-alive socket the server closed is reopened once."""
        for attempt in range(2):
            fresh = self._streams is None
            if self._streams is None:
                self._streams = await asyncio.open_connection(self.host, self.port)
            try:
                return await self._exchange(*self._streams, path, body)
            except (asyncio.IncompleteReadError, ConnectionError):
                await self.close()
                if fresh or attempt:
                    raise
        raise AssertionError("unreachable")

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        path: bytes, body: bytes) -> tuple[int, bytes]:
        """Write one request and read its reply."""
        writer.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s"
                     % (path, self.host.encode(), len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        length, keep = 0, True
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                keep = False
        data = await reader.readexactly(length)
        if not keep:
            await self.close()
        return int(head[9:12]), data

    async def close(self) -> None:
        """Close the socket (the next post opens a new one)."""
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL prompt file (each with ``messages`` or ``prompt``)."""
    with path.open("rb") as fh:
        return [orjson.loads(line) for line in fh if line.strip()]


def chat_body(row: dict[str, Any], max_new_tokens: int) -> bytes:
    """The /v1/chat/completions body of one prompt row."""
    row = row.get("body") or row  # an OpenAI-batch line carries its request in "body"
    messages = row.get("messages") or [{"role": "user", "content": row.get("prompt", "")}]
    # A row's own max_tokens applies under the ceiling, as the fleet's --max-new-tokens does.
    tokens = min(int(row.get("max_tokens") or max_new_tokens), max_new_tokens)
    return orjson.dumps({"messages": messages, "max_tokens": tokens})


async def _slot(url: str, rows: Iterator[dict[str, Any]], max_new_tokens: int,
                result: PlainResult, keep: bool) -> None:
    """One in-flight slot: send the next prompt as soon as the previous one is answered."""
    conn = Connection(url)
    try:
        for row in rows:
            try:
                status, data = await conn.post(CHAT_PATH, chat_body(row, max_new_tokens))
            except (OSError, asyncio.IncompleteReadError):
                status, data = 0, b""
            if status != 200:
                result.failed += 1
                continue
            reply = orjson.loads(data)
            result.completed += 1
            result.output_tokens += int(reply["usage"]["completion_tokens"])
            if keep:
                result.rows.append({"id": row.get("id"), "completion": reply["choices"][0]})
    finally:
        await conn.close()


async def run_plain(urls: list[str], prompts: list[dict[str, Any]], in_flight: int,
                    max_new_tokens: int, keep: bool = False) -> PlainResult:
    """Send every prompt with ``in_flight`` requests outstanding per server; return the figures."""
    result = PlainResult(in_flight=in_flight, servers=len(urls))
    rows = iter(prompts)  # shared: whichever slot is free takes the next prompt
    start, cpu = time.monotonic(), time.process_time()
    try:
        await asyncio.gather(*(_slot(url, rows, max_new_tokens, result, keep)
                               for url in urls for _ in range(in_flight)))
    finally:
        result.seconds = time.monotonic() - start
        result.cpu_seconds = time.process_time() - cpu
    return result


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; exit status 1 if any prompt failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--server", action="append", required=True, help="engine URL (repeat)")
    parser.add_argument("--in-flight", type=int, default=48, help="requests in flight per server")
    parser.add_argument("--max-new-tokens", type=int, default=7000)
    parser.add_argument("--out", type=Path, help="write one JSON line per completion here")
    args = parser.parse_args(argv)
    result = asyncio.run(run_plain(args.server, read_prompts(args.prompts), args.in_flight,
                                   args.max_new_tokens, keep=args.out is not None))
    if args.out:
        args.out.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in result.rows))
    print(f"{result.completed} completed, {result.failed} failed, {result.output_tokens:,} "
          f"tokens in {result.seconds:.1f} s = {result.tokens_per_s:,.0f} tok/s "
          f"({result.in_flight} in flight x {result.servers} servers)")
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
