"""Tools and structured output (issue 27): the simulator answers and refuses as SGLang does.
A job's tool calls and schema-bound answers coming back stored is tests/test_examples.py (the
tool_use and extraction recipes); a 'tools' that is not a list stopping enqueue is
tests/test_samples.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema
import orjson
import pytest

from tests.simproc import Sim, launch

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer", "minimum": 1}},
                   "required": ["city", "days"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"},
                                                    "minItems": 1}},
          "required": ["name", "age", "tags"]}


# One xdist worker runs this module, so its module fixture starts once (make test).
pytestmark = pytest.mark.xdist_group("sim-tools")


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sim, Sim]]:
    """Two fast simulators: one with a tool-call parser, one without."""
    args = ["--model-path", "Qwen/Qwen3-0.6B", "--context-length", "4096"]
    env = {"FLEET_SIM_SPEED": "1000", "FLEET_SIM_MEAN_OUTPUT_TOKENS": "20"}
    with_parser = launch(tmp_path_factory.mktemp("p"), [*args, "--tool-call-parser", "qwen25"],
                         env)
    plain = launch(tmp_path_factory.mktemp("n"), args, env)
    with_parser.wait_ready()
    plain.wait_ready()
    yield with_parser, plain
    with_parser.stop()
    plain.stop()


def _chat(**body: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 32,
            **body}


def test_tool_calls_come_back_parsed_only_with_a_parser(sims) -> None:
    parser, plain = sims
    res = parser.post("/v1/chat/completions", _chat(tools=[WEATHER], tool_choice="required"))
    assert res.status_code == 200, res.text
    choice = res.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(orjson.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert parser.post("/v1/chat/completions", _chat(tools=[WEATHER], tool_choice=named)
                       ).json()["choices"][0]["message"]["tool_calls"]
    none = parser.post("/v1/chat/completions", _chat(tools=[WEATHER], tool_choice="none"))
    assert none.json()["choices"][0]["message"]["tool_calls"] is None
    text = plain.post("/v1/chat/completions", _chat(tools=[WEATHER], tool_choice="required"))
    assert text.status_code == 200 and text.json()["choices"][0]["message"]["tool_calls"] is None


@pytest.mark.parametrize(("body", "message"), [
    (_chat(tool_choice="required"), "Tools cannot be empty if tool choice is set to required."),
    (_chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "Tool 'nope' not found in tools list."),
    (_chat(tool_choice={"type": "function", "function": {"name": "x"}}),
     "Tools cannot be empty if tool choice is set to a specific tool."),
    (_chat(tools={"get_weather": WEATHER}), "tools: Input should be a valid list"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nonsense"}}}]), "Tool 0 function has invalid 'parameters' schema"),
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "p"}}),
     "schema: Field required"),
])
def test_chat_refusals_are_sglangs(sims, body, message) -> None:
    res = sims[0].post("/v1/chat/completions", body)
    assert res.status_code == 400 and message in res.text, res.text


def test_schemas_bind_the_answer_on_both_routes(sims) -> None:
    sim = sims[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chat = sim.post("/v1/chat/completions", _chat(response_format=fmt))
    assert chat.status_code == 200, chat.text
    jsonschema.validate(orjson.loads(chat.json()["choices"][0]["message"]["content"]), PERSON)
    gen = sim.post("/generate", {"text": "Extract: Ada, 36", "sampling_params": {
        "max_new_tokens": 32, "json_schema": orjson.dumps(PERSON).decode()}})
    assert gen.status_code == 200, gen.text
    jsonschema.validate(orjson.loads(gen.json()["text"]), PERSON)
    for params, message in (({"regex": "(unclosed"}, "Invalid grammar request"),
                            ({"json_schema": "{not json"}, "Invalid grammar request"),
                            ({"regex": "a+", "ebnf": "root ::= \"a\""}, "Only one of")):
        res = sim.post("/generate", {"text": "x", "sampling_params": params})
        assert res.status_code == 400 and message in res.text, res.text
    assert sim.post("/generate", {"text": "x", "sampling_params": {"regex": "[0-9]+"}}
                    ).status_code == 200


def test_parallel_sampling_prefills_the_prompt_once_as_sglang_does(sims) -> None:
    """``n`` on one /generate request: the prompt is prefilled first (max_new_tokens = 0) and
    the n copies find it cached (TokenizerManager._handle_batch_request); copies of a prompt
    sent together without that step all compute it (one prefill round shares nothing)."""
    sim = sims[1]
    prompt = "A long shared question. " * 80
    res = sim.post("/generate", {"text": prompt, "sampling_params": {"n": 4,
                                                                      "max_new_tokens": 8}})
    assert res.status_code == 200 and len(res.json()) == 4
    assert all(x["meta_info"]["cached_tokens"] > 0 for x in res.json())
    other = "Another long question, sent as four copies at once. " * 40
    res = sim.post("/generate", {"text": [other] * 4, "sampling_params": {"max_new_tokens": 8}})
    assert [x["meta_info"]["cached_tokens"] for x in res.json()] == [0, 0, 0, 0]
