"""The model's own tokenizer and chat template, applied as SpecForge applies them.

SpecForge (``specforge/data/parse.py``, ``GeneralParser.parse``) renders a conversation with
``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
tools=...)``, encodes the text with ``add_special_tokens=False`` and sets the loss mask from
the assistant header to the end-of-turn token (inclusive). The same here, for the one
assistant turn the engine generated (the input's own assistant turns are context: mask 0),
with the text rendered per row and encoded in one batch by the fast tokenizer (its Rust
``encode_batch_fast``); the span's token positions are SpecForge's: the encoded length of the
text before each end.

Needs ``transformers`` (the ``export`` extra: ``pip install 'gpu-batch-fleet[export]'``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.errors import JobError

_USER, _ANSWER = "\x00fleet-user\x00", "\x00fleet-answer\x00"


@dataclass(frozen=True)
class Encoded:
    """One batch encoded: per row its ids and the ``[start, end)`` token span of the answer."""

    ids: list[list[int]]
    spans: list[tuple[int, int]]
    texts: list[str]


def auto_tokenizer_class() -> Any:
    """transformers' ``AutoTokenizer``, imported without its advice that PyTorch was not
    found (only the tokenizer is used; a TRANSFORMERS_NO_ADVISORY_WARNINGS already set
    wins); ImportError when transformers is not installed."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer


def _load(path: Path) -> Any:
    try:
        AutoTokenizer = auto_tokenizer_class()  # noqa: N806 (transformers' class)
    except ImportError as exc:
        raise JobError("the tokens export needs transformers: pip install "
                       "'gpu-batch-fleet[export]' (or pip install transformers)") from exc
    if not path.is_dir():
        raise JobError(f"{path}: no tokenizer folder there (pass --tokenizer PATH)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise JobError(f"{path}: cannot load a tokenizer: {exc}") from exc
    if not getattr(tok, "is_fast", False):
        raise JobError(f"{path}: a fast tokenizer (tokenizer.json) is needed")
    if not tok.chat_template:
        raise JobError(f"{path}: the tokenizer has no chat template")
    return tok


def _before_end(ids: list[int], end_id: int) -> list[int]:
    """``ids`` without a closing end-of-turn token (and what follows it, e.g. a newline)."""
    tail = ids[-2:]
    if end_id in tail:
        return ids[:len(ids) - len(tail) + tail.index(end_id)]
    return ids


class ChatTokenizer:
    """A model folder's tokenizer with its chat template (``template_kwargs``: the job's
    ``--chat-template-kwargs``, e.g. ``{"enable_thinking": false}``)."""

    def __init__(self, path: Path, template_kwargs: dict[str, Any] | None = None) -> None:
        self.path = path
        self.tok = _load(path)
        self.kwargs = dict(template_kwargs or {})
        self._fast = self._compiled()
        self.header, self.end_of_turn = self._probe()
        end = self.end_of_turn.strip()
        self.end_id = self.tok.convert_tokens_to_ids(end) if end in self.tok.get_vocab() else None

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
        """The conversation's text, as SpecForge renders it (``apply_chat_template``)."""
        return str(self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                add_generation_prompt=False, **self.kwargs))

    def _compiled(self) -> Any:
        """The template compiled once by transformers' own compiler, or None where that
        helper is not there (then every row goes through :meth:`render`)."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:
            return None
        return _compile_jinja_template(self.tok.chat_template)

    def render_many(self, convs: list[tuple[list[dict[str, Any]], list[Any] | None]]
                    ) -> list[str]:
        """Texts of many conversations: the compiled template with the variables
        ``apply_chat_template`` passes (the special tokens, the template kwargs), checked
        against :meth:`render` on the first conversation; :meth:`render` for each otherwise."""
        if not convs:
            return []
        first = self.render(*convs[0])
        if self._fast is not None:
            env = {**self.tok.special_tokens_map, **self.kwargs, "add_generation_prompt": False}
            fast = [self._fast.render(messages=m, tools=t, **env) for m, t in convs]
            if fast[0] == first:
                return fast
            self._fast = None  # this template renders otherwise: the slow way from now on
        return [first, *(self.render(m, t) for m, t in convs[1:])]

    def _probe(self) -> tuple[str, str]:
        """(assistant header, end-of-turn text) of the template, read from two renders."""
        user = [{"role": "user", "content": _USER}]
        one = self.render(user, None)
        two = self.render([*user, {"role": "assistant", "content": _ANSWER}], None)
        at = two.find(_ANSWER)
        if at < 0 or not two.startswith(one[:one.find(_USER) + len(_USER)]):
            raise JobError(f"{self.path}: cannot find the assistant turn in the chat template")
        head = two[len(one):at] if two.startswith(one) else two[two.find(_USER) + len(_USER):at]
        head = head.split("<think>", 1)[0]  # a thinking template's empty block is content
        # Through the turn's own newline, as SpecForge's registered templates end a turn
        # ("<|im_end|>\n" for Qwen).
        tail = two[at + len(_ANSWER):]
        tail = tail[:len(tail.rstrip("\n")) + 1] if tail.endswith("\n") else tail
        if not head:
            raise JobError(f"{self.path}: the chat template shows no assistant header")
        return head, tail

    def answer_chars(self, text: str) -> tuple[int, int]:
        """Character span of the last assistant turn: after its header, through its end of
        turn (the end of the text when the template has none)."""
        start = text.rfind(self.header)
        if start < 0:
            return len(text), len(text)
        start += len(self.header)
        end = text.rfind(self.end_of_turn) if self.end_of_turn else -1
        return start, (end + len(self.end_of_turn) if end >= start else len(text))

    def encode(self, texts: list[str]) -> Encoded:
        """Encode ``texts`` in one batch; each row's answer span in tokens, as SpecForge
        counts it: the span starts at the number of tokens of the text before it and ends at
        the number of tokens of the text through it (the whole text's when it ends the text).
        No offsets are needed (``encode_batch_fast`` where the tokenizers release has it)."""
        backend = self.tok.backend_tokenizer
        fast = getattr(backend, "encode_batch_fast", backend.encode_batch)
        chars = [self.answer_chars(text) for text in texts]
        ids = [enc.ids for enc in fast(texts, add_special_tokens=False)]
        heads = fast([text[:start] for text, (start, _) in zip(texts, chars, strict=True)],
                     add_special_tokens=False)
        spans = [(len(head.ids), len(row)) for head, row in zip(heads, ids, strict=True)]
        cut = [n for n, (text, (_, end)) in enumerate(zip(texts, chars, strict=True))
               if end != len(text)]
        if cut:
            for n, enc in zip(cut, fast([texts[n][:chars[n][1]] for n in cut],
                                        add_special_tokens=False), strict=True):
                spans[n] = (spans[n][0], len(enc.ids))
        return Encoded(ids, spans, texts)

    def matches(self, span: list[int], engine: list[int]) -> bool:
        """Whether the answer span holds the engine's own ids: its last tokens are exactly
        ``engine``'s, the end-of-turn token aside (a truncated answer has none; a template may
        open the turn with text the engine did not generate, such as ``<think>\\n``)."""
        if self.end_id is not None:
            span = _before_end(span, self.end_id)
            engine = _before_end(engine, self.end_id)
        return bool(engine) and span[len(span) - len(engine):] == engine
