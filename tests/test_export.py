"""``python -m producer export``: the data set as Parquet, JSONL and OpenAI-batch output."""

from __future__ import annotations

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from tests.conftest import run_producer
from tests.test_sink import cli, local_root, make_job, prompt_rows
from workers.dataset.jobs import PromptRow
from workers.dataset.manifest import SCHEMA, committed_prefix
from workers.dataset.store import LocalStore


def _job(fleet_env, name: str = "ex") -> LocalStore:
    store = LocalStore(local_root(fleet_env))
    rows = prompt_rows(45)
    rows[4] = PromptRow(index=4, id="p4", error="line 5: no 'prompt' or 'messages'")
    make_job(store, name, rows, batch_size=10)
    res = cli({**fleet_env, "FLEET_SHARD_ROWS": "20"}, "sink", "--job", name, "--local")
    assert res.returncode == 0, res.stderr
    return store


def _lines(path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


def test_export_each_format(fleet_env, tmp_path, r):
    store = _job(fleet_env)
    folder = store.root / committed_prefix(store, "ex")
    shards = [pq.read_table(p) for p in sorted(folder.glob("*.parquet"))]
    assert len(shards) == 3
    expected = pa.concat_tables(shards)
    outs = {fmt: tmp_path / "out" / f"ex.{fmt}" for fmt in ("parquet", "jsonl", "openai-batch")}
    for fmt, out in outs.items():
        run = run_producer if fmt == "openai-batch" else cli  # one real process, the rest fast
        res = run(fleet_env, "export", "--job", "ex", "--format", fmt, "--out", str(out))
        assert res.returncode == 0, res.stderr
        unit = "lines (one per prompt)" if fmt == "openai-batch" else "rows"
        assert f"wrote 45 {unit}" in res.stderr, res.stderr
        assert "ok 40 + errors 5 = 45 rows" in res.stderr, res.stderr
    table = pq.read_table(outs["parquet"])
    assert table.schema.equals(SCHEMA) and table.equals(expected)
    assert _lines(outs["jsonl"]) == expected.to_pylist()
    assert not list((tmp_path / "out").glob(".*"))  # no temporary files left behind

    lines = _lines(outs["openai-batch"])
    assert [x["custom_id"] for x in lines] == [f"p{i}" for i in range(45)]
    assert len({x["id"] for x in lines}) == 45
    chat, text, failed, quarantined = lines[0], lines[1], lines[5], lines[4]
    assert set(chat) == {"id", "custom_id", "response", "error"} and chat["error"] is None
    assert chat["response"]["status_code"] == 200 and chat["response"]["request_id"]
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "Qwen/Qwen3.6-27B"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "answer to p0",
        "reasoning_content": "thinking",
    }
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}
    assert text["response"]["body"]["object"] == "text_completion"
    assert text["response"]["body"]["choices"][0]["text"] == "answer to p1"
    # Per-request failures sit in the response, as in OpenAI's batch output; error is null.
    assert failed["error"] is None and quarantined["error"] is None
    assert failed["response"]["status_code"] == 500 and failed["response"]["request_id"]
    assert failed["response"]["body"] == {"error": {
        "message": "engine said no", "type": "server_error", "param": None,
        "code": "generation_failed"}}
    assert quarantined["response"]["status_code"] == 400
    assert quarantined["response"]["body"]["error"]["code"] == "quarantined"
    assert quarantined["response"]["body"]["error"]["type"] == "invalid_request_error"
    # Reproducible: a second export writes the same bytes.
    again = tmp_path / "again.jsonl"
    cli(fleet_env, "export", "--job", "ex", "--format", "openai-batch", "--out", str(again))
    assert again.read_bytes() == outs["openai-batch"].read_bytes()


def test_export_refuses_without_a_data_set_or_with_a_damaged_shard(fleet_env, tmp_path, r):
    store = LocalStore(local_root(fleet_env))
    make_job(store, "raw", prompt_rows(10), batch_size=10)
    res = cli(
        fleet_env, "export", "--job", "raw", "--format", "jsonl", "--out", str(tmp_path / "x.jsonl")
    )
    assert res.returncode == 3 and "sink --job raw" in res.stderr
    store = _job(fleet_env, "bad")
    shard = store.root / committed_prefix(store, "bad") / "part-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:-1] + b"X")
    out = tmp_path / "bad.parquet"
    res = cli(fleet_env, "export", "--job", "bad", "--format", "parquet", "--out", str(out))
    assert res.returncode == 3 and "does not match its sha256" in res.stderr
    assert not out.exists() and not list(tmp_path.glob(".bad*"))
    res = cli(fleet_env, "export", "--job", "bad", "--format", "csv", "--out", str(out))
    assert res.returncode == 3 and "unknown format" in res.stderr


def test_openai_batch_keeps_the_reasoning_of_plain_prompts_sent_as_chats(fleet_env, tmp_path,
                                                                         r):
    """``--chat`` sent plain prompts through the chat route: their answers are chat
    completions, the reasoning apart, not text completions that drop it."""
    from workers.dataset.jobs import SamplingSpec

    store = LocalStore(local_root(fleet_env))
    rows = [PromptRow(index=i, id=f"q{i}", prompt=f"Question {i}") for i in range(4)]
    make_job(store, "chatty", rows, batch_size=4,
             sampling=SamplingSpec(max_new_tokens=64, chat=True), fail=lambda i: False)
    assert cli(fleet_env, "sink", "--job", "chatty", "--local").returncode == 0
    out = tmp_path / "chatty.jsonl"
    assert cli(fleet_env, "export", "--job", "chatty", "--format", "openai-batch", "--out",
               str(out)).returncode == 0
    for line in _lines(out):
        body = line["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["reasoning_content"] == "thinking"
