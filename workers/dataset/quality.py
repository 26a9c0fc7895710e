"""The quality of a job's rows, measured while they stream by (docs/output.md, "quality").

Every row the sink writes (and every row ``verify`` reads) goes through one
:class:`QualityTally`; the figures and their denominators are declared once, in
:data:`workers.dataset.quality_gates.FIGURES`. A row is judged by its kind (:func:`judge`):

- not ok: ``failed`` or ``quarantined`` (the manifest's buckets), nothing else;
- cut at max_tokens (``finish_reason`` ``length``): ``truncated``, nothing else (its answer is
  not finished, so it is neither near-empty nor of a broken form);
- tool calls, or structured output asked for (:mod:`workers.dataset.row_form`): a *formed* row,
  judged by its form: ``invalid`` when the calls or the output do not parse or match;
- any other answered row is a *text* row: ``near_empty`` when its answer (the completion once
  the reasoning is split off and any ``<think>`` block cut out) is whitespace only, or shorter
  than ``near_empty_tokens``; ``identical`` when its answer is also another prompt's
  (compared by UTF-8 length and first and last ``KEY_CHARS`` bytes, hashed, over at most
  ``MAX_DISTINCT`` distinct answers: memory stays bounded);
- thinking-mode rows (a launch with a reasoning parser, thinking not turned off), text or
  formed: ``no_reasoning`` (no reasoning) and ``markers`` (``<think>`` / ``</think>`` left in
  ``completion``);
- ``same_samples``: prompts of several samples at temperature > 0 whose text samples are all
  equal;
- ``completion_tokens``: percentiles (p1, p5, p50, p95, p99) over answered rows, from a
  bounded histogram (exact below 256 tokens, then 64 log-spaced buckets per doubling), and the
  exact ``max`` (the report's own, producer/report.py).

Each figure keeps at most ``EXAMPLES`` example row ids. Shares are of their own denominator,
as fractions in 0..1.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from workers.dataset.manifest import row_bucket
from workers.dataset.quality_gates import COUNTED, EXAMPLES, shares
from workers.dataset.quality_options import QualityOptions
from workers.dataset.row_form import form_ok, tool_calls_ok

MAX_DISTINCT = 200_000  # distinct answers remembered for ``identical``
# Answers are compared by their UTF-8 length and their first and last KEY_CHARS bytes
# (hashing each whole answer would cost the sink ~6 µs per 10k characters).
KEY_CHARS = 256
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Histogram of completion tokens: one bucket per token below EXACT, then BUCKETS_PER_DOUBLING
# log-spaced buckets per doubling (a percentile is off by < 1.1 % above EXACT).
EXACT, BUCKETS_PER_DOUBLING = 256, 64
PERCENTILES = (1, 5, 50, 95, 99)


def _bucket(tokens: int) -> int:
    if tokens < EXACT:
        return max(tokens, 0)
    return EXACT + int(math.log2(tokens / EXACT) * BUCKETS_PER_DOUBLING)


def _bucket_floor(b: int) -> int:
    if b < EXACT:
        return b
    return math.ceil(EXACT * 2 ** ((b - EXACT) / BUCKETS_PER_DOUBLING))


def answer_of(row: dict[str, Any]) -> str:
    """The answer of a row: its completion with any ``<think>`` block cut out (an unclosed
    ``<think>`` runs to the end)."""
    text = row.get("completion") or ""
    if THINK_CLOSE in text:
        text = text.rsplit(THINK_CLOSE, 1)[-1]
    if THINK_OPEN in text:
        text = text.split(THINK_OPEN, 1)[0]
    return text


def _nbytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


def answer_tokens(row: dict[str, Any], answer: str) -> int:
    """Tokens of the answer: the row's completion tokens, less the reasoning's share of them
    (split by UTF-8 bytes: the engine reports one count for both)."""
    tokens = int(row.get("completion_tokens") or 0)
    reasoning = row.get("reasoning") or ""
    completion = row.get("completion") or ""
    if reasoning or len(answer) < len(completion):
        text = _nbytes(reasoning) + _nbytes(completion)
        return round(tokens * (_nbytes(answer) / text)) if text else 0
    return tokens


def answer_key(answer: str) -> int:
    """What ``identical`` compares: the answer's UTF-8 length and first and last KEY_CHARS
    bytes, hashed."""
    b = answer.encode()
    return hash(b"%d|%s|%s" % (len(b), b[:KEY_CHARS], b[-KEY_CHARS:]))


def _rid(row: dict[str, Any]) -> str:
    """The row's id as the examples name it."""
    rid = row.get("id")
    return str(rid if rid is not None else row.get("index"))


@dataclass
class Figure:
    """One counted figure: how many rows, and a few of their ids."""

    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, row_id: str) -> None:
        """Count one row."""
        self.count += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(row_id)


class Verdict(NamedTuple):
    """What :func:`judge` says of one row: its ``kind`` (failed, quarantined, truncated, text,
    formed), the per-row figures it falls under, its answer, and whether it is of thinking
    mode."""

    kind: str
    flags: tuple[str, ...]
    answer: str
    thinking: bool


def _near_empty(row: dict[str, Any], answer: str, split: bool, threshold: int) -> bool:
    """Whether a text row's answer is blank or under ``threshold`` tokens (``split``: part of
    the completion tokens were reasoning or a ``<think>`` block)."""
    if not answer or answer.isspace():
        return True
    tokens = answer_tokens(row, answer) if split else (row.get("completion_tokens") or 0)
    return tokens < threshold


def judge(row: dict[str, Any], options: QualityOptions) -> Verdict:
    """The per-row figures of ``row`` (see the module docstring): one rule for the sink,
    ``verify``, the live tally and ``requeue --where``."""
    get = row.get
    if get("status") != "ok":
        bucket = row_bucket(row)
        return Verdict(bucket, (bucket,), "", False)
    if get("finish_reason") == "length":
        return Verdict("truncated", ("truncated",), "", False)
    completion = get("completion") or ""
    reasoning = get("reasoning") or ""
    # "<" first: one memchr pass, where the substring search costs ~10 µs per 10k chars.
    marked = "<" in completion and "think>" in completion
    answer = answer_of(row) if marked else completion
    calls = get("tool_calls")
    constraint = None if calls else options.constraint(row)
    if calls or constraint is not None:
        kind = "formed"
        ok = tool_calls_ok(calls) if calls else form_ok(constraint, answer)  # type: ignore
        flags = [] if ok else ["invalid"]
    else:
        kind = "text"
        flags = ["near_empty"] if _near_empty(row, answer, bool(reasoning or marked),
                                              options.near_empty_tokens) else []
    thinking = options.is_thinking(row)
    if thinking:
        if not reasoning or reasoning.isspace():
            flags.append("no_reasoning")
        if marked and (THINK_OPEN in completion or THINK_CLOSE in completion):
            flags.append("markers")
    return Verdict(kind, tuple(flags), answer, thinking)


@dataclass
class QualityTally:
    """Quality figures over a stream of rows, in bounded memory (see the module docstring)."""

    options: QualityOptions = field(default_factory=QualityOptions)
    rows: int = 0
    answered: int = 0
    texts: int = 0  # answered rows judged by their text
    formed: int = 0  # answered rows judged by their form (tool calls, structured output)
    thinking: int = 0
    figures: dict[str, Figure] = field(default_factory=lambda: {k: Figure() for k in COUNTED})
    _hist: dict[int, int] = field(default_factory=dict)
    # The most completion tokens of an answered row (exact: the histogram's top bucket is not).
    max_tokens: int = 0
    # answer hash -> (index, id) of its first row; once seen again, in _dups:
    # [index, id, rows, seen under another prompt]
    _answers: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    _dups: dict[int, list[Any]] = field(default_factory=dict)
    _prompt: list[Any] = field(default_factory=lambda: [None, set(), 0, ""])
    prompts_sampled: int = 0

    def add(self, row: dict[str, Any]) -> None:
        """Measure one row (rows of one prompt come one after another). Kept lean: the sink
        calls it for the rows its column path does not take (bench/quality.py)."""
        self.rows += 1
        verdict = judge(row, self.options)
        rid = _rid(row)
        for name in verdict.flags:
            self.figures[name].add(rid)
        key = None
        if verdict.kind in ("text", "formed", "truncated"):
            self.answered += 1
            tokens = row.get("completion_tokens") or 0
            b = tokens if tokens < EXACT else _bucket(tokens)
            self._hist[b] = self._hist.get(b, 0) + 1
            if tokens > self.max_tokens:
                self.max_tokens = tokens
            if verdict.kind == "formed":
                self.formed += 1
            elif verdict.kind == "text":
                self.texts += 1
                answer = verdict.answer
                if answer and not answer.isspace():
                    key = answer_key(answer)
                    self._identical(key, row)
            self.thinking += verdict.thinking
        if self.options.sampled:
            self._sample(row, key)

    def _identical(self, key: int, row: dict[str, Any]) -> None:
        # First sightings are (index, id) tuples of atoms, which the garbage collector stops
        # tracking: a dict of 200,000 lists would make every full collection walk them all.
        dup = self._dups.get(key)
        if dup is None:
            first = self._answers.get(key)
            if first is None:
                if len(self._answers) < MAX_DISTINCT:
                    self._answers[key] = (row.get("index"), row.get("id"))
                return
            dup = self._dups[key] = [first[0], first[1], 1, False]
        dup[2] += 1
        fig = self.figures["identical"]
        if dup[0] != row.get("index") and not dup[3]:
            dup[3] = True
            fig.add(str(dup[1] if dup[1] is not None else dup[0]))
            fig.count += dup[2] - 2  # earlier rows of the first prompt
        if dup[3]:
            fig.add(_rid(row))

    def identical_bulk(self, keys: list[int], indices: list[Any], ids: list[Any]) -> None:
        """:meth:`_identical` over many rows at once (in order): the keys seen nowhere else
        are stored in one C-level update, the others go row by row."""
        local = dict.fromkeys(keys)
        again = self._answers.keys() & local.keys()
        if len(local) < len(keys):  # repeats inside these rows
            counts = Counter(keys)
            again |= {k for k, n in counts.items() if n > 1}
        again |= self._dups.keys() & local.keys()
        if again:
            for k, index, rid in zip(keys, indices, ids, strict=True):
                if k in again:
                    self._identical(k, {"index": index, "id": rid})
        room = MAX_DISTINCT - len(self._answers)
        if room <= 0:
            return
        rows = zip(keys, zip(indices, ids, strict=True), strict=True)
        if again:
            rows = ((k, v) for k, v in rows if k not in again)
        if room >= len(keys):
            self._answers.update(rows)
        else:
            self._answers.update(itertools.islice(rows, room))

    def _sample(self, row: dict[str, Any], key: int | None) -> None:
        """Group a prompt's samples (one after another) and judge the group when it ends."""
        index = row.get("index")
        if index != self._prompt[0]:
            self._close_prompt()
            self._prompt = [index, set(), 0, _rid(row)]
        self._prompt[1].add(key)
        self._prompt[2] += 1

    def _close_prompt(self) -> None:
        index, keys, n, rid = self._prompt
        if index is not None and n > 1:
            self.prompts_sampled += 1
            if len(keys) == 1 and None not in keys:
                self.figures["same_samples"].add(rid)

    def percentiles(self) -> dict[str, int]:
        """Completion-token percentiles over answered rows (and ``max``)."""
        if not self._hist:
            return {}
        keys = sorted(self._hist)
        cum, acc = [], 0
        for k in keys:
            acc += self._hist[k]
            cum.append(acc)
        out = {}
        for p in PERCENTILES:
            at = bisect.bisect_left(cum, math.ceil(acc * p / 100))
            out[f"p{p}"] = _bucket_floor(keys[min(at, len(keys) - 1)])
        out["max"] = self.max_tokens
        return out

    def histogram(self) -> list[list[int]]:
        """[[lowest tokens of the bucket, rows], ...] of completion tokens (answered rows)."""
        return [[_bucket_floor(k), self._hist[k]] for k in sorted(self._hist)]

    def counters(self) -> dict[str, int]:
        """The denominators (quality_gates.COUNTERS) and the counted figures."""
        return {"rows": self.rows, "answered": self.answered, "texts": self.texts,
                "formed": self.formed, "thinking": self.thinking,
                "prompts_sampled": self.prompts_sampled,
                **{name: fig.count for name, fig in self.figures.items()}}

    def report(self) -> dict[str, Any]:
        """The figures as the manifest records them (see the module docstring)."""
        self._close_prompt()
        self._prompt = [None, set(), 0, ""]
        examples = {name: fig.examples for name, fig in self.figures.items()}
        return {"rows": self.rows, "answered": self.answered, "texts": self.texts,
                "formed": self.formed, "thinking_rows": self.thinking,
                "near_empty_tokens": self.options.near_empty_tokens,
                "completion_tokens": self.percentiles(), "histogram": self.histogram(),
                "figures": shares(self.counters(), examples)}
