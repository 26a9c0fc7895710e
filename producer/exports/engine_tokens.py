"""The tokens a drafter trains on: what the engine was sent, then what it generated.

A training row is ``input_ids = context + answer`` with ``loss_mask`` 0 over the context and 1
over the answer: the rows vLLM speculators' own regeneration writes
(``speculators/cli/regenerate_responses.py``: ``build_boundary_sample(prompt_token_ids,
completion_token_ids)``), and the pre-tokenized rows SpecForge's training takes as they are
(``specforge/data/prompt_builder.py::prepare_prompt_tasks``).

**Context**: the request the worker sent (:mod:`producer.exports.sent`), tokenized as SGLang
tokenizes it:

- chat (``serving_chat.py::_apply_jinja_template``): each assistant message's tool-call
  ``arguments`` parsed into an object (``normalize_assistant_tool_call_arguments``), a null
  content sent as ``""``, a tool message's list of text parts joined by spaces
  (``normalize_tool_content``), a last assistant message sent as a user message
  (``_handle_last_assistant_message``), then ``apply_chat_template(messages, tokenize=False,
  add_generation_prompt=True, tools=…, **chat_template_kwargs)`` encoded without added
  special tokens; so a template's default system prompt or ``<think>\\n`` priming is in the
  context exactly where the engine had it;
- a plain ``/generate`` prompt: ``tokenizer.encode(text)`` (``TokenizerManager``).

Its length is checked against the engine's own count (``prompt_tokens``).

**Answer**: the engine's own ``output_ids`` where it returned them (its stop token included).
Without them, the answer re-tokenized: the conversation with the generated turn rendered by the
template, the text after the context, through the template's end-of-turn token when that is a
stop token of the model (not what follows it, e.g. the newline after ``<|im_end|>``); a
truncated answer ends at its last character. Where both exist they are compared: a row whose
re-tokenized answer is not the engine's ids (their tail, where the template does not print a
generated turn's reasoning, as DeepSeek-R1's does not), or whose context length is not the
engine's count, is counted as differing (:class:`Checks`).

Needs ``transformers`` (the ``export`` extra: ``pip install 'gpu-batch-fleet[export]'``).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from producer.exports.sent import Sent
from workers.errors import JobError

_MARK = "\x00fleet-answer\x00"
# Rows named in the line that reports differing rows.
NAMED = 5


@dataclass
class TrainingRow:
    """One (prompt, sample) as token ids: ``context`` then ``answer`` make ``input_ids``."""

    context: list[int]
    answer: list[int]
    # Whether ``answer`` is the engine's own output_ids (else re-tokenized text).
    engine_ids: bool
    # Why the row differs from the engine ("" where it agrees or nothing could be compared).
    differs: str = ""
    # [start, end) token spans of the context that are supervised too (--train-input-turns:
    # the input's own assistant turns).
    context_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def input_ids(self) -> list[int]:
        """Context, then answer."""
        return self.context + self.answer

    @property
    def loss_mask(self) -> list[int]:
        """0 over the context (but its supervised spans), 1 over the answer."""
        mask = [0] * len(self.context)
        for start, end in self.context_spans:
            mask[start:end] = [1] * (end - start)
        return mask + [1] * len(self.answer)


@dataclass
class Checks:
    """Rows compared with the engine's own ids and counts, and those that differ."""

    compared: int = 0
    differ: int = 0
    named: list[str] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, row_id: str, row: TrainingRow, compared: bool) -> None:
        """Count one row."""
        self.compared += compared
        if row.differs:
            self.differ += 1
            self.reasons[row.differs] = self.reasons.get(row.differs, 0) + 1
            if len(self.named) < NAMED:
                self.named.append(row_id)

    def report(self) -> dict[str, Any]:
        """The figures an export returns."""
        return {"compared": self.compared, "differ": self.differ,
                "differ_reasons": dict(self.reasons), "differ_rows": list(self.named)}


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
        raise JobError("this export needs transformers: pip install "
                       "'gpu-batch-fleet[export]' (or pip install transformers)") from exc
    if not path.is_dir():
        raise JobError(f"{path}: no tokenizer folder there (pass --tokenizer PATH)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise JobError(f"{path}: cannot load a tokenizer: {exc}") from exc
    if not getattr(tok, "is_fast", False):
        raise JobError(f"{path}: a fast tokenizer (tokenizer.json) is needed")
    return tok


def _stop_ids(tok: Any, path: Path) -> set[int]:
    """The model's stop tokens: the tokenizer's eos and generation_config.json's
    ``eos_token_id`` (SGLang's ``ModelConfig`` reads both)."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = orjson.loads(gen.read_bytes()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return {int(i) for i in ids}


def _parse_arguments(message: dict[str, Any]) -> None:
    """An assistant message's tool-call ``arguments`` from JSON text to an object, in place
    (``normalize_assistant_tool_call_arguments``); text that is not JSON stays: the engine
    refuses such a request (HTTP 400), so no answered row has one in its context."""
    if message.get("role") != "assistant":
        return
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = orjson.loads(fn["arguments"])
            except orjson.JSONDecodeError:
                pass


def _text_parts(content: Any) -> bool:
    return isinstance(content, list) and all(
        isinstance(p, str) or (isinstance(p, dict) and p.get("type") == "text") for p in content)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as SGLang hands them to the chat template (see the module docstring)."""
    out = []
    for m in copy.deepcopy(messages):
        _parse_arguments(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("role") == "tool" and _text_parts(m["content"]):
            m["content"] = " ".join(p if isinstance(p, str) else p.get("text", "")
                                    for p in m["content"])
        out.append(m)
    if out and out[-1].get("role") == "assistant" and isinstance(out[-1].get("content"), str):
        out[-1] = {"role": "user", "content": out[-1]["content"]}
    return out


def generated_turn(rec: dict[str, Any]) -> dict[str, Any]:
    """The answer as the assistant message the template renders (reasoning apart, tool-call
    arguments as objects, as SGLang renders such a turn when it is sent back)."""
    turn: dict[str, Any] = {"role": "assistant", "content": rec.get("completion") or ""}
    if rec.get("reasoning") is not None:
        turn["reasoning_content"] = rec["reasoning"]
    if rec.get("tool_calls"):
        calls = rec["tool_calls"]
        turn["tool_calls"] = orjson.loads(calls) if isinstance(calls, str) else copy.deepcopy(
            calls)
    _parse_arguments(turn)
    return turn


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _same(engine: list[int], retok: list[int], tail_only: bool) -> bool:
    """Whether the re-tokenized answer is the engine's ids (``tail_only``: the answer holds
    what follows the reasoning, which the template does not print: the ids' tail)."""
    if tail_only:
        return len(retok) <= len(engine) and engine[len(engine) - len(retok):] == retok
    return engine == retok


class EngineTokens:
    """A model folder's tokenizer and chat template, used as the engine used them."""

    def __init__(self, path: Path, input_turns: bool = False) -> None:
        self.path = path
        # --train-input-turns: the input's own assistant turns are supervised too.
        self.input_turns = input_turns
        self.tok = _load(path)
        self.stop_ids = _stop_ids(self.tok, path)
        backend = self.tok.backend_tokenizer
        self._encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        self._tail: tuple[str, bool] | None = None

    def _render(self, messages: list[dict[str, Any]], sent: Sent, generation: bool) -> str:
        if not self.tok.chat_template:
            raise JobError(f"{self.path}: the tokenizer has no chat template, and this job "
                           "sent chat requests")
        try:
            return str(self.tok.apply_chat_template(
                messages, tools=sent.tools, tokenize=False, add_generation_prompt=generation,
                **sent.template_kwargs))
        except Exception:  # noqa: BLE001 - SGLang retries with function-only tools
            pass
        tools = [t.get("function", t) for t in sent.tools or []] or None
        try:
            return str(self.tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation,
                **sent.template_kwargs))
        except Exception as exc:  # noqa: BLE001 - jinja's errors are many types
            raise JobError(f"{self.path}: its chat template cannot render a conversation "
                           f"the engine answered ({type(exc).__name__}: {exc}); is it the "
                           "job's model?") from exc

    def end_of_turn(self, sent: Sent) -> tuple[str, bool]:
        """(the text the template puts after an assistant turn's content, through its stop
        token when it has one; whether it has one)."""
        if self._tail is None:
            user = [{"role": "user", "content": "q"}]
            two = self._render([*user, {"role": "assistant", "content": _MARK}],
                               Sent(None, user, None, sent.template_kwargs), False)
            at = two.rfind(_MARK)
            if at < 0:
                raise JobError(f"{self.path}: the chat template does not render an "
                               "assistant turn's content")
            tail = two[at + len(_MARK):]
            stops = [self.tok.convert_ids_to_tokens(i) for i in self.stop_ids]
            hits = [(tail.find(s), s) for s in stops if s and s in tail]
            if hits:
                pos, stop = min(hits)
                self._tail = (tail[:pos + len(stop)], True)
            else:
                self._tail = (tail.rstrip(), False)
        return self._tail

    def _encode_texts(self, texts: list[str], special: bool) -> list[list[int]]:
        if not texts:
            return []
        return [e.ids for e in self._encode(texts, add_special_tokens=special)]

    def _chat_answer(self, rec: dict[str, Any], sent: Sent) -> tuple[str, str, bool, bool]:
        """(context text, answer text, whether a stop token follows the answer unprinted,
        whether the answer is only what follows an unprinted reasoning) of a chat row."""
        finished = rec.get("finish_reason") != "length"
        msgs = template_messages(sent.messages or [])
        ctx = self._render(msgs, sent, True)
        full = self._render([*msgs, generated_turn(rec)], sent, False)
        answer = full[_common_prefix(ctx, full):]
        tail, has_stop = self.end_of_turn(sent)
        cut = answer.rfind(tail) if tail else -1
        if cut >= 0:
            answer = answer[:cut] + (tail if finished and has_stop else "")
        last = rec.get("completion") or rec.get("reasoning") or ""
        if not finished and last and (end := answer.rfind(last)) >= 0:
            answer = answer[:end + len(last)]  # the template's closers were not generated
        reasoning = (rec.get("reasoning") or "").strip()
        # A template that does not print a generated turn's reasoning: the answer is the rest.
        return ctx, answer, finished and not has_stop, bool(reasoning) and reasoning not in answer

    def _context_ids(self, sents: list[Sent], chat: dict[int, str]) -> list[list[int]]:
        """The context ids of each request (``chat``: the rendered text of its chat ones):
        a chat text encoded without added special tokens, a plain prompt as /generate does."""
        plain = {n: s.prompt or "" for n, s in enumerate(sents) if s.messages is None}
        out: list[list[int]] = [[] for _ in sents]
        for texts, special in ((chat, False), (plain, True)):
            for n, ids in zip(texts, self._encode_texts(list(texts.values()), special),
                              strict=True):
                out[n] = ids
        return out

    def context_lengths(self, sents: list[Sent]) -> list[int]:
        """Tokens of each request as the engine counts its input (see the module docstring)."""
        chat = {n: self._render(template_messages(s.messages), s, True)
                for n, s in enumerate(sents) if s.messages is not None}
        return [len(ids) for ids in self._context_ids(sents, chat)]

    def _input_turns(self, ctx: str, sent: Sent) -> list[tuple[int, int]]:
        """Character spans of the context's assistant turns (the input's own): from where the
        template opens the turn's content through its stop token, as SpecForge masks them."""
        msgs = template_messages(sent.messages or [])
        stop, has_stop = self.end_of_turn(sent)
        spans = []
        for i, m in enumerate(msgs):
            if m.get("role") != "assistant":
                continue
            start = _common_prefix(self._render(msgs[:i], sent, True), ctx)
            end = ctx.find(stop, start) if has_stop else -1
            if end >= 0:
                spans.append((start, end + len(stop)))
        return spans

    def _token_spans(self, ctx: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Character spans as token spans of ``ctx``: the encoded length of the text before
        each end (SpecForge's arithmetic)."""
        cuts = self._encode_texts([ctx[:c] for span in spans for c in span], False)
        return [(len(cuts[2 * k]), len(cuts[2 * k + 1])) for k in range(len(spans))]

    def rows(self, recs: list[dict[str, Any]], sents: list[Sent]) -> list[TrainingRow]:
        """Training rows of answered data-set rows and the requests they answered."""
        chat_ctx: dict[int, str] = {}
        answers: dict[int, str] = {}
        eos_after: set[int] = set()
        tail_only: set[int] = set()
        for n, (rec, sent) in enumerate(zip(recs, sents, strict=True)):
            if sent.messages is None:
                answers[n] = rec.get("completion") or ""
                stop = rec.get("finish_reason") == "stop"
            else:
                chat_ctx[n], answers[n], stop, tail = self._chat_answer(rec, sent)
                if tail:
                    tail_only.add(n)
            if stop:
                eos_after.add(n)
        ctx_ids = self._context_ids(sents, chat_ctx)
        ans_ids = dict(zip(answers, self._encode_texts(list(answers.values()), False),
                           strict=True))
        eos = self.tok.eos_token_id
        out = []
        for n, rec in enumerate(recs):
            retok = ans_ids[n] + ([eos] if n in eos_after and eos is not None else [])
            engine = rec.get("output_ids")
            context = ctx_ids[n]
            row = TrainingRow(context, list(engine) if engine is not None else retok,
                              engine is not None)
            expected = int(rec.get("prompt_tokens") or 0)
            if expected and len(context) != expected:
                row.differs = "context"
            elif engine is not None and not _same(list(engine), retok, n in tail_only):
                row.differs = "answer"
            if self.input_turns and n in chat_ctx:
                row.context_spans = self._token_spans(
                    chat_ctx[n], self._input_turns(chat_ctx[n], sents[n]))
            out.append(row)
        return out

    def decode(self, rows: list[list[int]]) -> list[str]:
        """Texts of ``rows`` with every special token shown (speculators' ``text``)."""
        return list(self.tok.backend_tokenizer.decode_batch(rows, skip_special_tokens=False))
