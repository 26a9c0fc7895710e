"""The engine's own sampled token ids: where SGLang returns them, per route and release, and
how the client, the stored row and the simulator carry them (tests/fixtures/token_ids/)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.realfixtures import exchange
from tests.simproc import launch
from workers.engine.client import parse_chat, parse_generate
from workers.engine.releases import KNOWN, traits

FIXTURE = Path(__file__).parent / "fixtures" / "token_ids" / "routes.json"
MODELS = Path(__file__).parent / "fixtures" / "models"


def test_generate_returns_output_ids_on_the_real_engine() -> None:
    for name in ("12_generate_plain", "14_generate_batch2", "24_generate_n2"):
        body = exchange("big80", name).json()
        items = body if isinstance(body, list) else [body]
        for item in items:
            got = parse_generate(item, 0.0)
            assert got.output_ids == item["output_ids"]
            assert len(got.output_ids) == got.completion_tokens > 0


def test_the_0_5_11_chat_route_has_no_ids_and_ignores_the_request_field() -> None:
    plain = exchange("big80", "38_chat_plain")
    assert parse_chat(plain.json(), 0.0).output_ids is None
    unknown = exchange("big80", "42_chat_seed_user_unknown")
    assert unknown.request is not None and "foo" in unknown.request and unknown.status == 200


def test_each_release_s_chat_key_is_the_one_read_from_its_wheel() -> None:
    rows = json.loads(FIXTURE.read_text())["chat"]
    keys = {"0.5.11": None, "0.5.16": None, "0.5.17": "token_ids", "0.5.18": "response_token_ids",
            "0.5.23": "response_token_ids"}
    for version, key in keys.items():
        assert traits(version).chat_token_ids_key == key, version
    assert [r["choice_key"] for r in rows] == [None, "token_ids", "response_token_ids"]
    assert KNOWN[-1] == "0.5.23"
    example = next(v for k, v in json.loads(FIXTURE.read_text()).items() if k.startswith("example"))
    assert parse_chat({"choices": [example]}, 0.0).output_ids == example["response_token_ids"]
    assert parse_chat({"choices": [{"token_ids": [1, 2]}]}, 0.0).output_ids == [1, 2]


def test_the_sim_answers_return_token_ids_as_the_played_release(tmp_path: Path) -> None:
    argv = ["--model-path", str(MODELS / "qwen3-tiny"), "--context-length", "4096"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
            "return_token_ids": True}
    for version, key in (("0.5.11", None), ("0.5.17", "token_ids"),
                         ("0.5.23", "response_token_ids")):
        sim = launch(tmp_path, argv, {"FLEET_SIM_SGLANG_VERSION": version},
                     log_name=f"sim-{version}.log")
        try:
            sim.wait_ready()
            doc = httpx.post(f"{sim.url}/v1/chat/completions", json=body, timeout=30).json()
            gen = httpx.post(f"{sim.url}/generate", timeout=30, json={
                "text": "hi", "sampling_params": {"max_new_tokens": 5}}).json()
        finally:
            sim.stop()
        choice = doc["choices"][0]
        assert {"token_ids", "response_token_ids"} & set(choice) == ({key} if key else set())
        got = parse_chat(doc, 0.0)
        if key:
            assert len(got.output_ids) == doc["usage"]["completion_tokens"]
        else:
            assert got.output_ids is None
        assert len(parse_generate(gen, 0.0).output_ids) == gen["meta_info"]["completion_tokens"]
