"""N samples per prompt: how many a row asks for, how each (prompt, sample) is keyed, and the
seed each sample gets.

A job's prompts are staged once (one staged row per prompt, kept columns included); each
prompt stands for ``n`` units of work, its samples ``0 … n-1``. A row's own OpenAI-batch
``n`` wins over the job's (``enqueue --samples N`` or ``--sampling n=N``).

A sample is keyed in a batch's progress hash by :func:`unit_key`: the bare index for sample 0
(so a one-sample job keys exactly as before) and ``"<index>:<sample>"`` for the others. The
stored result row carries ``sample`` as an integer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

# sampling_seed must fit the engine's int64 tensors; 31 bits also fit every JSON reader.
SEED_BITS = 31


def row_samples(params: dict[str, Any] | None, job_samples: int) -> int:
    """Samples a row asks for: its own ``n`` when it has one, else the job's."""
    own = (params or {}).get("n")
    return int(own) if isinstance(own, int) and not isinstance(own, bool) and own >= 1 \
        else max(1, int(job_samples or 1))


def unit_key(index: int, sample: int) -> str:
    """Progress-hash field of one (prompt, sample)."""
    return str(index) if sample == 0 else f"{index}:{sample}"


def parse_unit_key(key: str | bytes) -> tuple[int, int]:
    """(index, sample) of a progress-hash field."""
    text = key.decode() if isinstance(key, bytes) else key
    index, _, sample = text.partition(":")
    return int(index), int(sample or 0)


def row_unit(row: dict[str, Any]) -> tuple[int, int]:
    """(index, sample) of a stored result row (rows from before samples are sample 0)."""
    return int(row["index"]), int(row.get("sample") or 0)


def row_key(row: dict[str, Any]) -> str:
    """Progress-hash field of a stored result row."""
    return unit_key(*row_unit(row))


def prompt_units(rows: Iterable[Any], job_samples: int) -> Iterator[tuple[Any, int]]:
    """(row, sample) for every sample of every staged row (``row.params``: its own ``n``)."""
    for row in rows:
        for sample in range(row_samples(row.params, job_samples)):
            yield row, sample


def sample_seed(seed: int | None, prompt: Any, sample: int) -> int:
    """The sampling seed of one sample, derived from (seed, prompt, sample): samples of one
    prompt differ, a rerun of the same input draws the same ones, and the same prompt in
    another job with the same seed gets the same samples (so ``--reuse-from`` can match)."""
    doc = orjson.dumps([seed if seed is not None else 0, prompt, sample],
                       option=orjson.OPT_SORT_KEYS)
    digest = hashlib.blake2b(doc, digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)
