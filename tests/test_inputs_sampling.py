"""Sampling keys: OpenAI names mapped to SGLang's, keys the engine refuses refused at enqueue
(or dropped with a count), and job-level options in the request bodies the engine receives."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from producer.readers import ReadOptions, read_rows
from tests.conftest import run_producer, wait_done
from workers.batch.prompt_sampling import sampling_for
from workers.dataset.jobs import JobSpec, PromptRow, SamplingSpec, load_spec
from workers.dataset.store import open_store
from workers.dataset.verify import batch_rows, stored_batches
from workers.engine.client import EngineClient
from workers.engine.sampling import (
    SAMPLING_PARAMS,
    SamplingError,
    job_params,
    translate,
)
from workers.errors import InputError


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def _batch_line(cid: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", **body}}


def test_openai_names_map_to_sglang_keywords():
    t = translate({"seed": 7, "max_completion_tokens": 9, "max_tokens": 50, "min_tokens": 2,
                   "stop": ["x"], "presence_penalty": 0.5, "user": "u1", "logprobs": 3,
                   "n": 1}, chat=False)
    assert t.sampling == {"sampling_seed": 7, "max_new_tokens": 9, "min_new_tokens": 2,
                          "stop": ["x"], "presence_penalty": 0.5}
    assert set(t.sampling) <= set(SAMPLING_PARAMS)
    assert t.logprobs == {"return_logprob": True, "top_logprobs_num": 3}
    assert t.dropped == ["user"]


@pytest.mark.parametrize(("params", "chat", "match", "droppable"), [
    ({"echo": True}, False, "'echo' is not a sampling parameter", True),
    ({"best_of": 2}, True, "'best_of' is not a sampling parameter", True),
    ({"n": 0}, False, "'n' is 0: the samples per prompt must be at least 1", False),
    ({"top_k": "20"}, False, "'top_k' must be an integer, got '20'", False),
    ({"temperature": None}, False, "'temperature' must be a number", False),
    ({"ignore_eos": 1}, False, "'ignore_eos' must be true or false", False),
    ({"structural_tag": "{}"}, True, "'structural_tag' has no equivalent in a chat request",
     True),
    ({"tools": {"f": 1}}, True, "'tools' must be a list of tool definitions", False),
    ({"regex": "a+", "ebnf": "x"}, False, "takes one of json_schema, regex or ebnf", False),
    ({"chat_template_kwargs": {}}, False, "applies to chat requests only", True),
    ({"top_p": 0}, False, r"'top_p' must be in \(0, 1\], got 0", False),
    ({"presence_penalty": 2.5}, False, r"'presence_penalty' must be in \[-2, 2\]", False),
    ({"top_k": 0}, False, "'top_k' must be -1 \\(disable\\) or at least 1, got 0", False),
    ({"max_tokens": -1}, True, r"'max_tokens' must be in \[0, inf\)", False),
])
def test_keys_the_engine_refuses_are_named(params, chat, match, droppable):
    with pytest.raises(SamplingError, match=match) as info:
        translate(params, chat)
    assert info.value.droppable is droppable


def test_job_level_sampling_flags_parse_json_else_strings():
    assert job_params(["top_k=20", "min_p=0", "stop=[\"END\"]", "seed=3", "stop_regex=a+"]) == {
        "top_k": 20, "min_p": 0, "stop": ["END"], "sampling_seed": 3, "stop_regex": "a+"}
    with pytest.raises(SamplingError, match="'user' is not a sampling parameter"):
        job_params(["user=me"])
    with pytest.raises(SamplingError, match="'top_k' must be an integer"):
        job_params(["top_k=high"])


def test_an_unsupported_row_key_stops_the_read_naming_file_line_and_key(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [
        _batch_line("a", messages=[{"role": "user", "content": "x"}], seed=1),
        _batch_line("b", prompt="p", echo=True)])
    with pytest.raises(InputError, match=r"in\.jsonl:2: sampling key 'echo' is not .*"
                                         r"--drop-unsupported-sampling drops it"):
        list(read_rows(src))


def test_the_drop_flag_drops_unsupported_keys_and_counts_them(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [
        _batch_line("a", prompt="p", echo=True, user="u", seed=1),
        _batch_line("b", prompt="q", echo=False, best_of=1),
        _batch_line("c", messages=[{"role": "user", "content": "x"}], user="u")])
    opts = ReadOptions(drop_unsupported=True)
    rows = list(read_rows(src, opts))
    assert rows[0]["params"] == {"user": "u", "seed": 1}  # staged; user is never sent
    assert "params" not in rows[1]
    assert opts.dropped == {"echo": 2, "best_of": 1, "user": 2}


def test_n_samples_at_temperature_0_are_refused_even_with_the_drop_flag(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [_batch_line("a", prompt="p", n=8, temperature=0)])
    with pytest.raises(InputError, match=r"in\.jsonl:1: sampling key 'n' asks for 8 samples "
                       "per prompt at temperature 0"):
        list(read_rows(src, ReadOptions(drop_unsupported=True)))
    src = _jsonl(tmp_path / "ok.jsonl", [_batch_line("a", prompt="p", n=8)])
    assert [r["params"] for r in read_rows(src, ReadOptions())] == [{"n": 8}]


def test_refusals_are_one_line_from_the_command(fleet_env, tmp_path, r):
    src = _jsonl(tmp_path / "in.jsonl", [_batch_line("a", prompt="p", logit_bias=[1])])
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "refused")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        f"error: {src}:1: sampling key 'logit_bias' must be an object of numbers, got [1]"]
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "refused2", "--sampling", "k=1")
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: --sampling: sampling key 'k' is not a sampling parameter SGLang accepts"]


# --- what the engine receives ------------------------------------------------------------
class Recorder:
    """A real HTTP server answering /generate and /v1/chat/completions like SGLang (shapes
    only) and keeping every request body it received."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, dict[str, Any]]] = []

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append((request.path, body))
        if request.path == "/generate":
            return web.json_response({"text": "ok", "meta_info": {
                "finish_reason": {"type": "stop"}, "prompt_tokens": 1, "completion_tokens": 1}})
        return web.json_response({"choices": [{"message": {"content": "ok"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    async def send(self, spec: JobSpec, rows: list[PromptRow]) -> None:
        app = web.Application()
        app.router.add_post("/generate", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        runner = web.AppRunner(app)
        await runner.setup()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        client = EngineClient(f"http://127.0.0.1:{port}", 10.0, 4)
        try:
            for row in rows:
                await client.complete(row.prompt, row.messages, sampling_for(spec, row))
        finally:
            await client.aclose()
            await runner.cleanup()


def _spec(**sampling: Any) -> JobSpec:
    return JobSpec(name="j", total=1, batch_size=1, n_batches=1, input_path="x",
                   input_fingerprint="f", sampling=SamplingSpec(**sampling))


def test_job_level_chat_options_reach_the_request_bodies():
    spec = _spec(max_new_tokens=100, temperature=0.6,
                 params={"top_k": 20, "min_p": 0.0, "presence_penalty": 1.5, "sampling_seed": 3},
                 chat=True, system_prompt="Be brief.",
                 chat_template_kwargs={"enable_thinking": False})
    rows = [
        PromptRow(index=0, id="a", prompt="plain"),
        PromptRow(index=1, id="b", messages=[{"role": "system", "content": "own"},
                                             {"role": "user", "content": "hi"}]),
        PromptRow(index=2, id="c", messages=[{"role": "user", "content": "x"}],
                  params={"max_tokens": 500, "seed": 9, "temperature": 0.1, "user": "u",
                          "logprobs": True, "chat_template_kwargs": {"x": 1}}),
        PromptRow(index=3, id="d", prompt="short", params={"max_tokens": 5}),
    ]
    rec = Recorder()
    asyncio.run(rec.send(spec, rows))
    assert [p for p, _ in rec.bodies] == ["/v1/chat/completions"] * 4
    a, b, c, d = (body for _, body in rec.bodies)
    assert a == {"messages": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "plain"}],
                 "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5, "seed": 3,
                 "chat_template_kwargs": {"enable_thinking": False},
                 "max_tokens": 100, "temperature": 0.6, "return_token_ids": True}
    assert b["messages"][0] == {"role": "system", "content": "own"}  # the row's own wins
    assert (c["seed"], c["temperature"], c["max_tokens"], c["logprobs"]) == (9, 0.1, 100, True)
    assert c["chat_template_kwargs"] == {"enable_thinking": False, "x": 1} and "user" not in c
    assert d["max_tokens"] == 5  # a row's max_tokens applies when below the ceiling


def test_generate_bodies_carry_sglang_keywords_only():
    spec = _spec(params={"top_k": 20, "stop": ["END"]})
    rows = [PromptRow(index=0, id="a", prompt="p",
                      params={"seed": 1, "max_completion_tokens": 7, "user": "u",
                              "logprobs": True, "top_logprobs": 2, "n": 1})]
    rec = Recorder()
    asyncio.run(rec.send(spec, rows))
    path, body = rec.bodies[0]
    assert path == "/generate"
    assert body == {"text": "p", "return_logprob": True, "top_logprobs_num": 2,
                    "sampling_params": {"top_k": 20, "stop": ["END"], "sampling_seed": 1,
                                        "max_new_tokens": 7}}
    assert set(body["sampling_params"]) <= set(SAMPLING_PARAMS)


def _job_rows(store: Any, job: str) -> list[dict[str, Any]]:
    """Every stored row of ``job``, all its batches, in row order."""
    rows = [r for b in stored_batches(store, job) for r in batch_rows(store, job, b).rows]
    return sorted(rows, key=lambda r: r["index"])


def test_openai_batch_with_seed_user_logprobs_runs_to_ok(fleet_env, make_workers, tmp_path, r):
    src = _jsonl(tmp_path / "batch.jsonl", [
        _batch_line(f"c{i}", seed=i, user="team-a", logprobs=True, max_tokens=8,
                    **({"prompt": f"p{i}"} if i % 2 else
                       {"messages": [{"role": "user", "content": f"m{i}"}]}))
        for i in range(6)])
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "oai", "--chat",
                       "--system-prompt", "Be brief.", "--sampling", "top_k=20",
                       "--chat-template-kwargs", '{"enable_thinking": false}')
    assert res.returncode == 0, res.stderr
    assert "user (6 rows)" in res.stderr
    make_workers([0])
    st = wait_done(fleet_env, "oai")
    assert (st["completed"], st["failed"]) == (6, 0)
    spec = load_spec(open_store(fleet_env["FLEET_STORE_URL"]), "oai")
    assert spec.dropped_keys == {"user": 6}
    assert spec.sampling.model_dump() == {
        "max_new_tokens": None, "temperature": None, "top_p": None, "params": {"top_k": 20},
        "chat": True, "system_prompt": "Be brief.",
        "chat_template_kwargs": {"enable_thinking": False}, "drop_unsupported": False,
        "samples": 1}
    # The logprobs the rows asked for are kept (as the engine's JSON), one per output token.
    store = open_store(fleet_env["FLEET_STORE_URL"])
    rows = _job_rows(store, "oai")
    assert len(rows) == 6
    for row in rows:
        content = orjson.loads(row["logprobs"])["content"]
        assert len(content) == row["completion_tokens"]  # the stop token too, as in SGLang
    # Plain prompts go to /generate: return_logprob and top_logprobs_num, kept the same way.
    src = _jsonl(tmp_path / "gen.jsonl", [
        {"custom_id": f"g{i}", "body": {"prompt": f"p{i}", "max_tokens": 8, "logprobs": 2}}
        for i in range(3)] + [{"custom_id": "none", "body": {"prompt": "q", "max_tokens": 8}}])
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "gen").returncode == 0
    assert wait_done(fleet_env, "gen")["completed"] == 4
    rows = _job_rows(store, "gen")  # a job of 4 rows on 1 GPU is 2 batches (batch_size.py)
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["logprobs"] is None  # not asked for, not stored
    for row in rows[:-1]:
        got = orjson.loads(row["logprobs"])
        assert len(got["output_token_logprobs"]) == row["completion_tokens"]
        assert {len(top) for top in got["output_top_logprobs"]} == {2}


def test_a_job_key_a_chat_request_cannot_carry_is_refused_at_the_first_chat_row(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": "p"},
                                         {"messages": [{"role": "user", "content": "x"}]}])
    opts = ReadOptions(job_params={"structural_tag": "{}"})
    with pytest.raises(InputError, match=r"in\.jsonl:2: sampling key 'structural_tag' "
                                         r"\(--sampling\) has no equivalent in a chat request$"):
        list(read_rows(src, opts))
    assert list(read_rows(src, ReadOptions(job_params={"top_k": 5})))[1]["messages"]


def test_a_plain_rerun_resumes_with_the_recorded_options(fleet_env, tmp_path, r):
    src = _jsonl(tmp_path / "in.jsonl", [
        _batch_line("a", prompt="p", chat_template_kwargs={"enable_thinking": True}),
        _batch_line("b", prompt="q", echo=True)])
    first = run_producer(fleet_env, "enqueue", str(src), "--job", "opts", "--chat",
                         "--drop-unsupported-sampling")
    assert first.returncode == 0, first.stderr
    assert "echo (1 row)" in first.stderr
    again = run_producer(fleet_env, "enqueue", str(src), "--job", "opts")
    assert again.returncode == 0, again.stderr
    assert "job opts resumed: 2 prompts" in again.stderr
    other = run_producer(fleet_env, "enqueue", str(src), "--job", "opts", "--sampling", "top_k=2")
    assert other.returncode == 3  # one line naming each flag that differs (issue 45, item 10)
    assert other.stderr.strip() == (
        "error: job 'opts' exists with other flags: --chat on (given off); "
        "--drop-unsupported-sampling on (given off); --sampling top_k=unset (given 2); "
        "re-run with the job's flags (or none of them) to resume, or use a new job name")
    other = run_producer(fleet_env, "enqueue", str(src), "--job", "opts", "--batch-size", "7")
    assert other.returncode == 3 and "--batch-size 500 (given 7)" in other.stderr, other.stderr
    assert "{" not in other.stderr


def test_the_job_cap_bounds_openai_lengths_but_not_a_requeued_rows_own_cap():
    spec = _spec(max_new_tokens=4)
    def length(**params):
        return sampling_for(spec, PromptRow(index=0, id="a", prompt="p",
                                            params=params)).max_new_tokens
    assert (length(), length(max_tokens=2), length(max_tokens=5000)) == (4, 2, 4)
    assert length(max_completion_tokens=5000, max_tokens=1) == 4
    assert length(max_new_tokens=5000) == 5000  # requeue-failed --max-new-tokens 5000
