"""Token counts, output lengths and filler text of the simulator.

No tokenizer is loaded. Token counts are approximations: a prompt costs ``ceil(chars / 4)``
tokens (about 4 characters per token for English text with BPE vocabularies), and a chat turn adds
a small template overhead. Output text is made of 3-letter words plus a space, so it re-counts to
the same number of tokens under the same rule, and is built by slicing, never token by token.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any

CHARS_PER_TOKEN = 4
# Qwen-style chat template: "<|im_start|>{role}\n" + "<|im_end|>\n" ~ 5 tokens per message, and
# "<|im_start|>assistant\n" ~ 3 tokens for the generation prompt. Approximate.
CHAT_TOKENS_PER_MESSAGE = 5
CHAT_GENERATION_PROMPT_TOKENS = 3
# Share of a thinking-mode output that is reasoning. Not measured: the workload only says the
# traces are long; the sim puts the first 80 % of the drawn length in reasoning_content.
REASONING_SHARE = 0.8

_WORDS = ("the", "sim", "ran", "one", "new", "map", "for", "all", "key", "row", "set", "tag")
_UNIT = " ".join(_WORDS) + " "
# Token ids that stand for the filler words (arbitrary ids inside a 150k vocabulary).
_IDS = [1782, 4497, 10613, 825, 501, 2415, 369, 678, 1376, 2802, 738, 4772]


def count_text_tokens(text: str) -> int:
    """Approximate prompt tokens of ``text``: ``ceil(chars / 4)``, at least 1."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def _content_chars(content: Any) -> int:
    """Characters of an OpenAI message content (a string or a list of text parts)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(str(p.get("text", ""))) for p in content if isinstance(p, dict))
    return 0


def count_chat_tokens(messages: list[Any]) -> int:
    """Approximate prompt tokens of a chat conversation, template overhead included."""
    total = CHAT_GENERATION_PROMPT_TOKENS
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        total += CHAT_TOKENS_PER_MESSAGE + math.ceil(_content_chars(content) / CHARS_PER_TOKEN)
    return total


def filler_text(tokens: int) -> str:
    """Deterministic text of about ``tokens`` tokens (4 characters per token)."""
    if tokens <= 0:
        return ""
    repeats = tokens // len(_WORDS) + 1
    return (_UNIT * repeats)[: tokens * CHARS_PER_TOKEN - 1]


def filler_ids(tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Token ids matching :func:`filler_text`; the last one is ``eos_token_id`` when given."""
    if tokens <= 0:
        return []
    ids = (_IDS * (tokens // len(_IDS) + 1))[:tokens]
    if eos_token_id is not None:
        ids[-1] = eos_token_id
    return ids


def reasoning_split(completion_tokens: int, drawn_tokens: int) -> tuple[int, int]:
    """(reasoning, answer) tokens: the first 80 % of the drawn length is reasoning.

    A request cut by its length limit inside the reasoning has no answer at all, as happens with
    thinking models.
    """
    reasoning = min(completion_tokens, math.ceil(drawn_tokens * REASONING_SHARE))
    return reasoning, completion_tokens - reasoning


class OutputLengths:
    """Log-normal output lengths with a given mean (the observed run: mean ~2,490 tokens).

    Each prompt's length is drawn from a generator seeded by the run's seed and the prompt
    itself, so the same prompts give the same workload in every run, whatever the order or the
    concurrency they arrive with (one shared generator would hand lengths out by arrival order).
    """

    def __init__(self, mean_tokens: float, sigma: float, seed: int | None) -> None:
        self._seed = 0 if seed is None else seed
        self._sigma = sigma
        # For a log-normal, mean = exp(mu + sigma^2 / 2).
        self._mu = math.log(max(mean_tokens, 1.0)) - sigma * sigma / 2

    def draw(self, prompt: str) -> int:
        """The output length of ``prompt`` in tokens (at least 1), the same on every call."""
        digest = hashlib.blake2b(f"{self._seed}\0{prompt}".encode(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest, "big"))
        return max(1, round(rng.lognormvariate(self._mu, self._sigma)))


def filler_logprob(position: int) -> float:
    """A deterministic log probability for the token at ``position``."""
    return -0.05 - (position % 7) / 10


def _triple(logprob: float | None, token: int, with_text: bool) -> tuple[Any, ...]:
    """``(logprob, token_id, text or None)`` as ``detokenize_logprob_tokens`` writes it."""
    return logprob, token, (filler_word(token) if with_text else None)


def token_logprobs(ids: list[int], top: int, input_ids: list[int] | None = None,
                   with_text: bool = False) -> dict[str, Any]:
    """meta_info's logprob fields, as ``TokenizerManager.add_logprob_to_meta_info`` writes them
    (0.5.11): ``(logprob, token_id, text)`` per token (text None unless
    ``return_text_in_logprobs``), ``output_token_logprobs_length``, and with
    ``top_logprobs_num`` > 0 the ``top`` best per position. ``input_ids`` are the prompt tokens
    from ``logprob_start_len`` on (None or empty: the default start, output only); the first
    prompt token has no logprob (``None``) and no top list."""
    prompt = input_ids or []
    out: dict[str, Any] = {
        "input_token_logprobs": [
            _triple(None if i == 0 else filler_logprob(i), t, with_text)
            for i, t in enumerate(prompt)],
        "output_token_logprobs": [
            _triple(filler_logprob(i), t, with_text) for i, t in enumerate(ids)],
        "output_token_logprobs_length": len(ids),
    }
    if top > 0:
        def best(i: int, t: int) -> list[tuple[Any, ...]]:
            return [_triple(filler_logprob(i) - k, t + k, with_text) for k in range(top)]
        out["input_top_logprobs"] = [None if i == 0 else best(i, t) for i, t in enumerate(prompt)]
        out["output_top_logprobs"] = [best(i, t) for i, t in enumerate(ids)]
    return out


def filler_word(token: int) -> str:
    """The text of a filler token id (an id outside the filler set decodes to "")."""
    return f" {_WORDS[_IDS.index(token)]}" if token in _IDS else ""


def chat_logprobs(ids: list[int], top: int) -> dict[str, Any]:
    """The chat choice's ``logprobs`` (OpenAI's ChoiceLogprobs: one entry per output token,
    ``serving_chat`` ``_process_logprobs_tokens``)."""
    def entry(i: int, t: int) -> dict[str, Any]:
        token = _WORDS[i % len(_WORDS)]
        return {"token": token, "logprob": filler_logprob(i), "bytes": list(token.encode()),
                "top_logprobs": [{"token": token, "logprob": filler_logprob(i) - k,
                                  "bytes": list(token.encode())} for k in range(top)]}
    return {"content": [entry(i, t) for i, t in enumerate(ids)]}


def completion_logprobs(ids: list[int], top: int) -> dict[str, Any]:
    """A /v1/completions choice's ``logprobs`` (``serving_completions``
    ``_build_logprobs_response`` over output tokens: ``text_offset`` is -1 without ``echo``,
    ``top_logprobs`` one ``{token text: logprob}`` per token)."""
    words = [_WORDS[i % len(_WORDS)] for i in range(len(ids))]
    return {
        "text_offset": [-1] * len(ids),
        "token_logprobs": [filler_logprob(i) for i in range(len(ids))],
        "tokens": words,
        "top_logprobs": [{_WORDS[(i + k) % len(_WORDS)]: filler_logprob(i) - k
                          for k in range(top)} for i in range(len(ids))],
    }
