"""The simulator's radix (prefix) cache: which leading tokens of a prompt an earlier prompt left
in the KV pool, so prefill skips them.

A prompt is cut into blocks of :data:`BLOCK_TOKENS` tokens (64 characters of text at the sim's
4 characters per token, or 16 token ids) and each block is keyed by a hash chained over the ones
before it, so a key stands for the whole prefix up to its block, as a path in SGLang's radix
tree does (``mem_cache/radix_cache.py::RadixCache.match_prefix``). Matching walks the chain
while its keys are cached. At least the prompt's last token is always computed, as in SGLang
(``Req.init_next_round_input`` keeps one token to prefill).

Hybrid (Mamba) models can only resume from a prefix whose recurrent state was saved
(``mem_cache/mamba_radix_cache.py``): with ``extra_buffer`` every ``--mamba-track-interval``
tokens, so a match is floored to that interval; with ``no_buffer`` only where an earlier prompt
ended, so only a whole earlier prompt counts. Output tokens are not inserted (SGLang also caches
a finished request's output; prompts that quote earlier outputs hit less here).

Keys are evicted least recently used once they would exceed the KV pool's tokens (the radix
tree's evictable nodes go first when the pool is short; the sim does not tie eviction to the
running requests' use).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_TOKENS = 16
BLOCK_CHARS = BLOCK_TOKENS * 4


def mamba_slots_held(ratio: int, hybrid_strategy: str | None, chunk: int, input_len: int
                     ) -> int:
    """Mamba slots a running request holds (what "mamba num" counts: used, not evictable),
    for a pool of ``ratio`` slots per request (R) and a prompt of ``input_len`` tokens.

    Its own state (``HybridReqToTokenPool.alloc``), plus under extra_buffer the ping-pong
    track buffers (2 with overlap, 1 without: R - 3 of them), plus, with the radix cache,
    the prompt's state forked into the tree and locked while the request runs
    (``MambaRadixCache.cache_unfinished_req``): always under no_buffer, and under
    extra_buffer only when the prompt reached ``chunk`` (``mamba_cache_chunk_size``:
    ``ScheduleBatch`` tracks a prefill of >= max(FLA_CHUNK_SIZE 64, page size) tokens).
    Real 0.5.11 on an H200 (extra_buffer + MTP, R = 5): 3 per request with 22-55 token
    prompts, 4 with 250-8,184 (docs/simulator.md).
    """
    if ratio <= 1:
        return 1  # no radix cache
    if hybrid_strategy != "extra_buffer":
        return ratio - 1
    return ratio - 2 + (1 if input_len >= chunk else 0)


def prefix_keys(text: str = "", ids: Sequence[int] | None = None) -> tuple[int, ...]:
    """Chained hash keys of a prompt's whole blocks (text, or token ids when given)."""
    chunks: list[object]
    if ids is not None:
        chunks = [tuple(ids[i : i + BLOCK_TOKENS]) for i in range(0, len(ids), BLOCK_TOKENS)]
    else:
        chunks = [text[i : i + BLOCK_CHARS] for i in range(0, len(text), BLOCK_CHARS)]
    whole = chunks if not chunks or _full(chunks[-1]) else chunks[:-1]
    keys, key = [], 0
    for chunk in whole:
        key = hash((key, chunk))
        keys.append(key)
    return tuple(keys)


def _full(chunk: object) -> bool:
    size = BLOCK_TOKENS if isinstance(chunk, tuple) else BLOCK_CHARS
    return len(chunk) == size  # type: ignore[arg-type]


@dataclass(frozen=True)
class CacheMode:
    """How the engine's flags let prefixes be reused."""

    enabled: bool  # radix cache on (not --disable-radix-cache)
    hybrid_strategy: str | None = None  # "no_buffer" | "extra_buffer" on hybrid models
    track_interval: int = 256  # --mamba-track-interval


class PrefixCache:
    """Prefix keys held in the KV pool, least recently used first."""

    def __init__(self, mode: CacheMode, capacity_tokens: int) -> None:
        self.mode = mode
        self._capacity = max(1, capacity_tokens // BLOCK_TOKENS)
        self._keys: OrderedDict[int, None] = OrderedDict()
        self._ends: OrderedDict[int, None] = OrderedDict()  # keys where a prompt ended

    def match(self, keys: tuple[int, ...], input_len: int) -> int:
        """Tokens of the prompt already in the cache (never the last one)."""
        if not self.mode.enabled or not keys:
            return 0
        if self.mode.hybrid_strategy == "no_buffer":
            blocks = max((i + 1 for i, k in enumerate(keys) if k in self._ends), default=0)
        else:
            blocks = 0
            while blocks < len(keys) and keys[blocks] in self._keys:
                self._keys.move_to_end(keys[blocks])
                blocks += 1
        tokens = blocks * BLOCK_TOKENS
        if self.mode.hybrid_strategy == "extra_buffer":
            tokens -= tokens % max(1, self.mode.track_interval)
        return max(0, min(tokens, input_len - 1))

    def clear(self) -> None:
        """Drop every cached prefix (``/flush_cache``: ``Scheduler.flush_cache`` resets the
        tree)."""
        self._keys.clear()
        self._ends.clear()

    def insert(self, keys: tuple[int, ...]) -> None:
        """Cache a prefilled prompt's blocks."""
        if not self.mode.enabled or not keys:
            return
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        self._ends[keys[-1]] = None
        self._ends.move_to_end(keys[-1])
        while len(self._keys) > self._capacity:
            old, _ = self._keys.popitem(last=False)
            self._ends.pop(old, None)
