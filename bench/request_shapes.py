"""What each part of an HTTP request costs the engine's step, measured on one live engine.

At its cap, an engine stepped 2-4 % slower under HTTP clients (the fleet's and a plain one)
than under SGLang's in-process offline ``Engine`` on the same rows. The candidates are what
an HTTP client adds around the same generation: the chat route (template and reasoning parser
in the tokenizer manager) against ``/generate`` with the template applied once, stop strings
(``Req.check_finished`` decodes each request's tail every step to look for them) against stop
token ids, and probes sent beside the load: ``/health`` (SGLang runs a 1-token generation
through the scheduler for it, ``http_server.health_generate``) and ``/v1/loads``.

Each shape sends ``cap`` requests at once, all of exactly ``tokens`` new tokens (``ignore_eos``;
dummy weights rarely sample EOS anyway) with the model's own sampling, so every step of the
phase runs the same batch. Its figure is the engine's own: the mean ``gen throughput`` of the
scheduler's ``Decode batch`` lines with every slot running, the phase's first line left out
(``bench/log_occupancy.py`` reads the same lines), so client-side time cannot leak in.
Shapes run in one order and then in the reverse one, so an engine that speeds up over its
first minutes favours none.

    python -m bench.request_shapes --url http://127.0.0.1:30000 --cap 40 \\
        --log logs/engine-gpu0.log --model /path/to/model --tokens 240
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench import log_occupancy
from bench.engines import Poller
from bench.plain_client import Connection
from bench.sglang_anchor import model_sampling

SHAPES = ("chat", "chat+health", "chat+loads", "generate", "chat+stop")
# What the worker's engine monitor did before it skipped probes while tokens flow
# (FLEET_ENGINE_HEALTH_INTERVAL_S), and what the GPU check's samplers poll.
PROBES = {"chat+health": ("/health", 2.0), "chat+loads": ("/v1/loads", 0.5)}
# Strings a chat template's turn ends could be written as, where stop token ids would do.
STOP_STRINGS = ["<|im_end|>", "<|endoftext|>", "\n\nUser:"]
PROMPT = "Write a long story about a lighthouse keeper and the sea, chapter {i}."


def decode_lines(log: Path, start: float, end: float) -> list[tuple[int, float]]:
    """(running, gen tok/s) of the decode lines stamped strictly inside (start, end)."""
    return [(x.running, x.gen_tok_s) for x in log_occupancy.read(log)
            if x.kind == "Decode" and x.gen_tok_s is not None and start < x.at < end]


def bodies(shape: str, n: int, tokens: int, sampling: dict[str, Any],
           encode: Callable[[list[dict[str, str]]], list[int]]) -> tuple[bytes, list[bytes]]:
    """The path and the ``n`` request bodies of one shape."""
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": PROMPT.format(i=i)}]
        if shape == "generate":
            params = {**sampling, "max_new_tokens": tokens, "ignore_eos": True}
            out.append(orjson.dumps({"input_ids": encode(messages), "sampling_params": params}))
            continue
        # The fleet's chat body (workers/engine/client.py: return_token_ids, max_tokens).
        body = {"messages": messages, "return_token_ids": True, "max_tokens": tokens,
                "ignore_eos": True, **sampling}
        if shape == "chat+stop":
            body["stop"] = STOP_STRINGS
        out.append(orjson.dumps(body))
    return (b"/generate" if shape == "generate" else b"/v1/chat/completions"), out


async def _send(url: str, path: bytes, bodies_: list[bytes]) -> tuple[int, int]:
    """All bodies at once, one connection each: (answered, failed)."""
    async def one(body: bytes) -> bool:
        conn = Connection(url)
        try:
            status, _ = await conn.post(path, body)
            return status == 200
        except (OSError, asyncio.IncompleteReadError):
            return False
        finally:
            await conn.close()

    got = await asyncio.gather(*(one(b) for b in bodies_))
    return sum(got), len(got) - sum(got)


class Prober(Poller):
    """GET ``path`` every ``interval_s`` on its own thread, as a monitor beside the load does."""

    def __init__(self, url: str, path: str, interval_s: float) -> None:
        super().__init__(interval_s, timeout_s=25.0, name="prober")
        self.url, self.path, self.sent = url, path, 0

    def tick(self, http: httpx.Client) -> None:
        try:
            http.get(self.url + self.path)
        except httpx.HTTPError:
            pass
        self.sent += 1


def run_shape(url: str, cap: int, log: Path, shape: str, tokens: int, sampling: dict[str, Any],
              encode: Callable[[list[dict[str, str]]], list[int]]) -> dict[str, Any]:
    """One phase: ``cap`` requests of ``tokens`` tokens; the engine's decode lines at its cap."""
    path, reqs = bodies(shape, cap, tokens, sampling, encode)
    probe = PROBES.get(shape)
    start = time.time()
    if probe is None:
        answered, failed = asyncio.run(_send(url, path, reqs))
        probes = 0
    else:
        with Prober(url, *probe) as prober:
            answered, failed = asyncio.run(_send(url, path, reqs))
        probes = prober.sent
    end = time.time()
    time.sleep(1.2)  # the log's last line of the phase is flushed, and stamped before the next
    # The phase's first decode line is left out: its rate is over the steps since the line
    # before it, which take in the phase's prefill and the gap since the last phase.
    full = [tps for running, tps in decode_lines(log, start, end)[1:] if running >= cap]
    return {"shape": shape, "answered": answered, "failed": failed, "probes": probes,
            "seconds": round(end - start, 1), "decode_lines_at_cap": len(full),
            "gen_tok_s": round(sum(full) / len(full), 1) if full else None}


def measure(url: str, cap: int, log: Path, model: str, tokens: int,
            shapes: tuple[str, ...] = SHAPES) -> dict[str, Any]:
    """Every shape in order, then in the reverse order; per-shape means and ratios to chat."""
    from transformers import AutoTokenizer  # SGLang's own dependency

    tok = AutoTokenizer.from_pretrained(model)

    def encode(messages: list[dict[str, str]]) -> list[int]:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    sampling = model_sampling(model)
    runs = [run_shape(url, cap, log, s, tokens, sampling, encode)
            for s in (*shapes, *reversed(shapes))]
    means: dict[str, float | None] = {}
    for s in shapes:
        got = [r["gen_tok_s"] for r in runs if r["shape"] == s and r["gen_tok_s"]]
        means[s] = round(sum(got) / len(got), 1) if got else None
    base = means.get("chat")
    return {"tokens": tokens, "cap": cap, "sampling": sampling or "SGLang's defaults",
            "runs": runs, "gen_tok_s": means,
            "vs_chat": {s: round(v / base, 4) for s, v in means.items() if v and base}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--cap", type=int, required=True)
    ap.add_argument("--log", type=Path, required=True, help="the engine's log file")
    ap.add_argument("--model", required=True, help="model folder (tokenizer, generation config)")
    ap.add_argument("--tokens", type=int, default=240)
    args = ap.parse_args(argv)
    json.dump(measure(args.url, args.cap, args.log, args.model, args.tokens), sys.stdout,
              indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
