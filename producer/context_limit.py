"""Prompts longer than the model's context, found at ``enqueue`` and quarantined there.

SGLang refuses a request whose input, counted with the tokens it reserves for speculative
decoding, is not shorter than the context (``TokenizerManager._validate_one_request``; 400, "The
input (N tokens) is longer than the model's context length (C tokens)"). Such a row is known
at enqueue: it is staged with the reason (``too long for the context: ...``) and quarantined
when its batch runs, never sent.

The context is the job's launch profile's (FLEET_PROFILE): its ``context-length`` flag, else
the model's ``config.json``. Where the profile's model folder is on this machine (a folder, or
the Hugging Face cache) with a ``tokenizer.json``, rows are counted with the model's own
tokenizer and chat template, as the engine counts them. Otherwise a bound is used that never
quarantines a row the engine would take: a token spans at most :data:`MAX_TOKEN_BYTES` UTF-8
bytes, so a row has at least ``ceil(bytes / MAX_TOKEN_BYTES)`` tokens. A row that passes the
bound and is still too long is refused by the engine, and that 400 is quarantined too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from workers.dataset.jobs import SamplingSpec
from workers.errors import TOO_LONG

# The most UTF-8 bytes one token of a byte-level BPE vocabulary is taken to span when the
# model's tokenizer is not here (the test tokenizer's longest token spans 64).
MAX_TOKEN_BYTES = 256


@dataclass
class ContextLimit:
    """The context a job's rows must fit, and how they are counted."""

    context: int  # tokens (SGLang's context_len)
    reserved: int  # tokens SGLang adds to the input's count (speculative decoding)
    how: str  # "the model's tokenizer (PATH)" or the bound
    # Tokens of many rows, exact (None: the bound is used).
    count: Callable[[list[dict[str, Any]]], list[int]] | None = None

    @property
    def limit(self) -> int:
        """The first input length (tokens, the reserve left out) the engine refuses."""
        return self.context - self.reserved

    def reason(self, tokens: int, exact: bool) -> str:
        """The quarantine reason of a row of ``tokens`` (a bound's when not ``exact``)."""
        counted = f"{tokens:,} tokens" if exact else f"at least {tokens:,} tokens"
        reserve = f" less {self.reserved} reserved for speculative decoding" \
            if self.reserved else ""
        return (f"{TOO_LONG} {counted} by {self.how}, and the engine takes under "
                f"{self.limit:,} (context {self.context:,}{reserve})")

    def mark(self, rows: list[dict[str, Any]]) -> None:
        """Set ``error`` on each of ``rows`` (staged row dicts) that cannot fit the context
        (rows with an error already are left alone)."""
        open_rows = [i for i, r in enumerate(rows) if not r.get("error")]
        if self.count is None:
            for i in open_rows:
                least = math.ceil(_content_bytes(rows[i]) / MAX_TOKEN_BYTES)
                if least >= self.limit:
                    rows[i]["error"] = self.reason(least, exact=False)
            return
        # A token spans at least one byte of the rendered text, whose template adds well
        # under half the context: rows under half the limit in bytes are not counted.
        todo = [i for i in open_rows if _json_bytes(rows[i]) >= self.limit // 2]
        for i, tokens in zip(todo, self.count([rows[i] for i in todo]), strict=True):
            if tokens >= self.limit:
                rows[i]["error"] = self.reason(tokens, exact=True)


def _content_bytes(row: dict[str, Any]) -> int:
    """UTF-8 bytes of the text a row sends: its prompt, or its messages' contents (a content
    that is not a string as JSON). The rendered request holds at least these."""
    if row.get("prompt") is not None:
        return len(row["prompt"].encode())
    return sum(len(c.encode()) if isinstance(c := m.get("content"), str)
               else len(orjson.dumps(c)) if c is not None else 0
               for m in row.get("messages") or () if isinstance(m, dict))


def _json_bytes(row: dict[str, Any]) -> int:
    """UTF-8 bytes of a row's prompt, or of its messages and tools as JSON: with the keys and
    quotes, as many bytes as a chat template's own text around them, or more."""
    if row.get("prompt") is not None:
        return len(row["prompt"].encode())
    tools = (row.get("params") or {}).get("tools")
    return len(orjson.dumps(row.get("messages"))) + (len(orjson.dumps(tools)) if tools else 0)


def _tokenizer_folder(model_path: str) -> Path | None:
    """The model's folder on this machine (or its Hugging Face cache snapshot) holding a
    tokenizer.json; None when there is none."""
    from workers.engine.model_config import ModelConfigError, find_config

    try:
        folder = find_config(model_path).parent
    except ModelConfigError:
        return None
    return folder if (folder / "tokenizer.json").is_file() else None


def _counter(folder: Path, sampling: SamplingSpec
             ) -> Callable[[list[dict[str, Any]]], list[int]] | None:
    """Token counts of staged rows with the tokenizer in ``folder``, as the engine counts the
    requests the worker sends (producer/exports/engine_tokens.py). None when transformers
    cannot load it."""
    from producer.exports.engine_tokens import EngineTokens
    from producer.exports.sent import request_of
    from workers.dataset.jobs import PromptRow
    from workers.errors import JobError

    try:
        engine = EngineTokens(folder)
    except (ImportError, OSError, ValueError, JobError):
        return None

    def count(rows: list[dict[str, Any]]) -> list[int]:
        return engine.context_lengths([request_of(sampling, PromptRow.model_validate(r))
                                       for r in rows])

    return count


def context_limit(profile_name: str, sampling: SamplingSpec) -> ContextLimit | None:
    """The context the profile's engine enforces, and its counter (None when the profile's
    context is not known here: then only the engine checks)."""
    from config.launch_profile import ProfileError, load_profile
    from workers.engine.engine_flags import EngineFlags
    from workers.engine.model_config import ModelConfigError, model_shape
    from workers.engine.server_args import reserved_tokens

    try:
        profile = load_profile(profile_name)
    except ProfileError:
        return None
    model = str(profile.flag("model-path") or "")
    context = profile.flag("context-length")
    if context is None and model:
        try:
            context = model_shape(model).context_length
        except (ModelConfigError, OSError, ValueError):
            return None
    if not isinstance(context, int | str) or not int(context):
        return None
    reserved = reserved_tokens(EngineFlags.from_flags(profile.flags, env=profile.env))
    folder = _tokenizer_folder(model) if model else None
    count = _counter(folder, sampling) if folder else None
    how = (f"the model's tokenizer ({folder})" if count else
           f"a bound (no tokenizer of {model or 'the model'} here: UTF-8 bytes / "
           f"{MAX_TOKEN_BYTES})")
    return ContextLimit(int(context), reserved, how, count)
