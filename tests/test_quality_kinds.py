"""The quality gate judges a row by its kind: for every kind of row the fleet carries, what it
says of a good row (nothing: 0 good rows flagged) and of a bad one (the figure that names it),
on both the row path (verify, QualityTally.add) and the sink's column path (add_table).

The options come from a real job record (workers.dataset.quality.job_options): structured
output from the job's ``--sampling`` or the row's own staged ``params``, thinking from the
launch profile's reasoning parser (config/profiles/qwen36-27b.toml has one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa
import pytest

from workers.dataset.jobs import JobSpec, SamplingSpec
from workers.dataset.manifest import SCHEMA, to_record
from workers.dataset.quality import QualityTally, judge
from workers.dataset.quality_gates import evaluate, thresholds
from workers.dataset.quality_options import job_options
from workers.dataset.quality_table import add_table

SCHEMA_TEXT = orjson.dumps({"type": "object", "required": ["name", "age"],
                            "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}}}).decode()
GRAMMAR = 'root ::= answer " " digits\nanswer ::= "yes" | "no"\ndigits ::= [0-9]+  # a count'
PROFILE = "qwen36-27b"  # reasoning-parser qwen3
USER = [{"role": "user", "content": "q"}]
TURNS = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
         {"role": "user", "content": "and then?"}]
LONG = "a complete answer that says what the prompt asked for, in several words"


def _calls(arguments: str) -> str:
    return orjson.dumps([{"id": "call_0", "type": "function", "index": 0,
                          "function": {"name": "get_weather", "arguments": arguments}}]).decode()


@dataclass
class Kind:
    """A row kind: the job's sampling, the row's own params, a good row and a bad one (the
    fields that differ from a plain answered row) and the figure the bad one falls under."""

    sampling: dict[str, Any]
    good: dict[str, Any]
    bad: dict[str, Any]
    flag: str | tuple[str, ...]
    own: dict[str, Any] = field(default_factory=dict)


KINDS = {
    "plain": Kind({}, {"completion": LONG}, {"completion": "\n"}, "near_empty"),
    "plain, a few words under the token threshold": Kind(
        {}, {"completion": LONG}, {"completion": "ok.", "completion_tokens": 2}, "near_empty"),
    # Chat rows on this profile are of thinking mode: they come with their reasoning.
    "chat": Kind({"chat": True}, {"completion": LONG, "reasoning": "hmm " * 9},
                 {"completion": " ", "reasoning": "hmm"}, "near_empty"),
    "multi-turn": Kind({}, {"messages": TURNS, "completion": LONG, "reasoning": "so"},
                       {"messages": TURNS, "completion": "", "reasoning": "so"}, "near_empty"),
    "thinking on": Kind({}, {"messages": USER, "reasoning": "let me see " * 30,
                             "completion": LONG, "completion_tokens": 100},
                        {"messages": USER, "reasoning": "let me see " * 30, "completion": "\n"},
                        "near_empty"),
    "thinking on, no reasoning": Kind({}, {"messages": USER, "reasoning": "why " * 20,
                                           "completion": LONG},
                                      {"messages": USER, "completion": LONG}, "no_reasoning"),
    "thinking on, markers left": Kind({}, {"messages": USER, "reasoning": "why " * 20,
                                           "completion": LONG},
                                      # the parser found no reasoning: it is left in content
                                      {"messages": USER, "completion": f"<think>why</think>{LONG}"},
                                      ("no_reasoning", "markers")),
    "thinking off": Kind({"chat_template_kwargs": {"enable_thinking": False}},
                         {"messages": USER, "completion": LONG},
                         {"messages": USER, "completion": "  "}, "near_empty"),
    "thinking off (the row's own chat_template_kwargs)": Kind(
        {}, {"messages": USER, "completion": LONG}, {"messages": USER, "completion": "  "},
        "near_empty", own={"chat_template_kwargs": {"enable_thinking": False}}),
    "thinking off (the row's own reasoning_effort none)": Kind(
        {}, {"messages": USER, "completion": LONG}, {"messages": USER, "completion": "\n"},
        "near_empty", own={"reasoning_effort": "none"}),
    "tools: a call": Kind({"chat_template_kwargs": {"enable_thinking": False}},
                          {"messages": USER, "completion": None, "finish_reason": "tool_calls",
                           "tool_calls": _calls('{"city": "Paris"}'), "completion_tokens": 12},
                          {"messages": USER, "completion": None, "finish_reason": "tool_calls",
                           "tool_calls": _calls('{"city": "Par'), "completion_tokens": 9},
                          "invalid"),
    "tools: a call with thinking": Kind(
        {}, {"messages": USER, "completion": "", "reasoning": "I should call it", "tool_calls":
             _calls('{"city": "Paris"}'), "finish_reason": "tool_calls"},
        {"messages": USER, "completion": "", "reasoning": "hmm", "tool_calls":
         orjson.dumps([{"function": {"arguments": "{}"}}]).decode()}, "invalid"),
    "tools: answered in text": Kind({"chat_template_kwargs": {"enable_thinking": False}},
                                    {"messages": USER, "completion": LONG},
                                    {"messages": USER, "completion": "\n"}, "near_empty"),
    "json_schema": Kind({"params": {"json_schema": SCHEMA_TEXT}},
                        {"completion": '{"name":"x","age":0}', "completion_tokens": 9},
                        {"completion": '{"name":"x"', "completion_tokens": 4}, "invalid"),
    "json_schema, valid JSON of the wrong shape": Kind(
        {"params": {"json_schema": SCHEMA_TEXT}}, {"completion": '{"name":"x","age":0}'},
        {"completion": '{"name":"x","age":"old"}'}, "invalid"),
    "response_format json_schema (the row's own)": Kind(
        {"chat": True, "chat_template_kwargs": {"enable_thinking": False}},
        {"completion": '{"name": "y", "age": 3}', "completion_tokens": 11},
        {"completion": "   "}, "invalid",
        own={"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": orjson.loads(SCHEMA_TEXT)}}}),
    "response_format json_object": Kind(
        {"chat": True, "chat_template_kwargs": {"enable_thinking": False},
         "params": {"response_format": {"type": "json_object"}}},
        {"completion": "{}", "completion_tokens": 1}, {"completion": "[1, 2]"}, "invalid"),
    "regex": Kind({"params": {"regex": "(yes|no)"}}, {"completion": "no", "completion_tokens": 1},
                  {"completion": "perhaps"}, "invalid"),
    "regex (the row's own)": Kind({}, {"completion": "2026-12-06", "completion_tokens": 5},
                                  {"completion": "6 Dec 2026"}, "invalid",
                                  own={"regex": r"\d{4}-\d{2}-\d{2}"}),
    "ebnf": Kind({"params": {"ebnf": GRAMMAR}}, {"completion": "yes 12", "completion_tokens": 3},
                 {"completion": "yes twelve"}, "invalid"),
    "ebnf, thinking on": Kind({"params": {"ebnf": GRAMMAR}},
                              {"messages": USER, "reasoning": "count them", "completion": "no 0",
                               "completion_tokens": 6},
                              {"messages": USER, "reasoning": "count", "completion": ""},
                              "invalid"),
    "truncated (counted under truncated alone)": Kind(
        {}, {"messages": USER, "reasoning": "r " * 50, "completion": LONG},
        {"messages": USER, "reasoning": "r " * 4000, "completion": "", "finish_reason": "length",
         "completion_tokens": 4096}, "truncated"),
    "structured, truncated": Kind({"params": {"json_schema": SCHEMA_TEXT}},
                                  {"completion": '{"name":"x","age":0}'},
                                  {"completion": '{"name":"xxxxx', "finish_reason": "length"},
                                  "truncated"),
    "failed": Kind({}, {"completion": LONG}, {"status": "failed", "error": "engine said no",
                                               "completion": None}, "failed"),
}


def _spec(sampling: dict[str, Any]) -> JobSpec:
    return JobSpec(name="kinds", total=10, batch_size=10, n_batches=1, input_path="in.jsonl",
                   input_fingerprint="", sampling=SamplingSpec(**sampling))


def _row(i: int, fields: dict[str, Any]) -> dict[str, Any]:
    return {"index": i, "sample": 0, "id": f"r{i}", "prompt": "p", "messages": None,
            "status": "ok", "error": None, "finish_reason": "stop", "reasoning": None,
            "tool_calls": None, "completion_tokens": 40, "profile": PROFILE, **fields}


def _tallies(kind: Kind, row: dict[str, Any]) -> list[QualityTally]:
    """The row measured by the row path and by the sink's column path."""
    out = []
    for path in ("row", "table"):
        options = job_options(_spec(kind.sampling), 10)
        options.add_rows([{"index": row["index"], "params": kind.own}])
        tally = QualityTally(options)
        if path == "row":
            tally.add(row)
        else:
            add_table(tally, pa.Table.from_pylist([to_record(row)], schema=SCHEMA))
        out.append(tally)
    return out


@pytest.mark.parametrize("name", list(KINDS))
def test_a_good_row_of_every_kind_is_flagged_by_no_figure(name):
    kind = KINDS[name]
    row = _row(0, kind.good)
    options = job_options(_spec(kind.sampling), 10)
    options.add_rows([{"index": 0, "params": kind.own}])
    assert judge(row, options).flags == ()
    for tally in _tallies(kind, row):
        report = tally.report()
        assert {k: f["count"] for k, f in report["figures"].items() if f["count"]} == {}
        assert evaluate(report, thresholds(None)) == []


@pytest.mark.parametrize("name", list(KINDS))
def test_a_bad_row_of_every_kind_is_flagged_by_its_figures_alone(name):
    kind = KINDS[name]
    flags = kind.flag if isinstance(kind.flag, tuple) else (kind.flag,)
    row = _row(0, kind.bad)
    options = job_options(_spec(kind.sampling), 10)
    options.add_rows([{"index": 0, "params": kind.own}])
    assert judge(row, options).flags == flags
    for tally in _tallies(kind, row):
        report = tally.report()
        counted = {k: f["count"] for k, f in report["figures"].items() if f["count"]}
        gated = ["failed_or_quarantined" if f in ("failed", "quarantined") else f
                 for f in flags]
        assert counted == dict.fromkeys(sorted({*flags, *gated}), 1)
        assert sorted(g["gate"] for g in evaluate(report, thresholds(None))) == sorted(gated)


def test_n_samples_are_judged_each_and_together():
    """Of a job of 3 samples at temperature 0.8: each sample is judged as its own row; a
    prompt whose text samples are all equal is flagged by same_samples, one whose samples
    differ is not; structured samples that agree (an extraction) are not."""
    spec = _spec({"samples": 3, "temperature": 0.8}).model_copy(update={"total_samples": 30})
    options = job_options(spec, 10)
    tally = QualityTally(options)
    for s in range(3):
        tally.add({**_row(0, {"completion": f"{LONG}, take {s}"}), "sample": s})
    for s in range(3):
        tally.add({**_row(1, {"completion": LONG}), "sample": s})
    f = tally.report()["figures"]
    assert f["same_samples"]["count"] == 1 and f["same_samples"]["examples"] == ["r1"]
    assert f["same_samples"]["of"] == 2 and f["near_empty"]["count"] == 0

    structured = job_options(_spec({"samples": 3, "temperature": 0.8, "params": {
        "json_schema": SCHEMA_TEXT}}).model_copy(update={"total_samples": 30}), 10)
    tally = QualityTally(structured)
    for s in range(3):
        tally.add({**_row(0, {"completion": '{"name":"x","age":0}'}), "sample": s})
    assert tally.report()["figures"]["same_samples"]["count"] == 0
    bad = {**_row(1, {"completion": " "}), "sample": 1}
    assert judge(bad, options).flags == ("near_empty",)


def test_the_sinks_column_path_agrees_with_the_row_path_on_every_kind():
    """A row group mixing every kind above (each good and bad row once, in one job whose own
    rows ask for their structured output): the sink's add_table and verify's row path give
    the same figures, counters and denominators."""
    rows, own = [], []
    for i, kind in enumerate(k for k in KINDS.values() for _ in (0, 1)):
        params = {**kind.sampling.get("params", {}), **kind.own}
        rows.append(_row(i, kind.good if i % 2 == 0 else kind.bad))
        own.append({"index": i, "params": params})
    spec = _spec({"chat": False})
    a, b = QualityTally(job_options(spec, 10)), QualityTally(job_options(spec, 10))
    a.options.add_rows(own)
    b.options.add_rows(own)
    for row in rows:
        a.add(row)
    add_table(b, pa.Table.from_pylist([to_record(x) for x in rows], schema=SCHEMA))
    ra, rb = a.report(), b.report()
    assert _no_examples(ra) == _no_examples(rb)
    assert ra["formed"] > 0 and ra["texts"] > 0 and ra["figures"]["invalid"]["count"] > 0
    plain = QualityTally(job_options(spec, 10))  # no row asks for structured output
    plain_t = QualityTally(job_options(spec, 10))
    for row in rows:
        plain.add(row)
    add_table(plain_t, pa.Table.from_pylist([to_record(x) for x in rows], schema=SCHEMA))
    assert _no_examples(plain.report()) == _no_examples(plain_t.report())


def _no_examples(report: dict[str, Any]) -> dict[str, Any]:
    """A report less its example ids (the column path takes rows in another order)."""
    return {**report, "figures": {k: {**f, "examples": None}
                                  for k, f in report["figures"].items()}}


def test_the_figures_and_their_gates_are_declared_once():
    """The manifest's figures, the gates and the live tally's figures are the table's
    (quality_gates.FIGURES), and the live tally shares its counts out by the same rule as the
    sink's report."""
    from workers.dataset.quality_gates import FIGURES, GATES, PER_ROW, shares
    from workers.delivery.quality_live import LIVE

    tally = QualityTally(job_options(_spec({}), 10))
    for i, kind in enumerate(KINDS.values()):
        tally.add(_row(i, kind.bad))
    report = tally.report()
    assert list(report["figures"]) == list(FIGURES)
    assert set(GATES) <= set(FIGURES) and set(PER_ROW) <= set(LIVE) <= set(FIGURES)
    counts = tally.counters()
    examples = {n: f["examples"] for n, f in report["figures"].items()}
    assert shares(counts, examples, LIVE) == {n: report["figures"][n] for n in LIVE}
