"""Issue 45: a newcomer's path, second pass: the demo's Redis and enqueue's answers (items 1,
2, 3, 9, 14, 15; item 10 is in tests/test_inputs_sampling.py; the views' items are in
tests/test_newcomer_views.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from producer import demo
from producer.localfleet import RedisServer, free_port
from tests.conftest import run_producer, wait_done, write_prompts
from tests.test_sink import cli, local_root
from workers.dataset.jobs import decode_rows, load_batch_input, result_key
from workers.dataset.manifest import row_bucket
from workers.dataset.store import LocalStore
from workers.errors import ENGINE_REJECTED, TOO_LONG

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer"


def test_demo_starts_its_own_redis_unless_fleet_redis_url_is_set(
        redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 1: without FLEET_REDIS_URL the demo never uses a Redis that merely answers."""
    url, server = demo._redis(None, tmp_path / "redis")
    try:
        assert server is not None and server.port != redis_server.port
        assert url == server.url and server.client().ping()
    finally:
        if server:
            server.stop()
    assert demo._redis(redis_server.url, tmp_path / "r2") == (redis_server.url, None)
    with pytest.raises(demo.DemoRedisError, match="FLEET_REDIS_URL is set"):
        demo._redis(f"redis://:pw@127.0.0.1:{free_port()}/0", tmp_path / "r3")


def test_demo_main_ends_on_a_silent_fleet_redis_url(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FLEET_REDIS_URL", f"redis://:secret-pw@127.0.0.1:{free_port()}/0")
    assert demo.main() == 4
    err = capsys.readouterr().err
    assert "does not answer" in err and "secret-pw" not in err


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in rows))
    return path


def test_a_prompt_over_the_context_is_quarantined_at_enqueue_or_on_the_engines_400(
        fleet_env, r, tmp_path, make_workers) -> None:
    """Item 2: qwen36-27b's context is 8192 (4 tokens reserved for MTP) and its tokenizer is
    not here: a prompt over 8188 x 256 UTF-8 bytes is quarantined at enqueue by the bound;
    one the bound lets through (40,000 bytes) is refused by the engine (the sim counts 10,000
    tokens) and that 400 is quarantined, not failed."""
    huge, long = "a" * (8188 * 256 + 1), "word " * 8000
    src = _jsonl(tmp_path / "in.jsonl", [{"id": "ok", "prompt": "hi"},
                                         {"id": "huge", "prompt": huge},
                                         {"id": "long", "prompt": long}])
    res = cli(fleet_env, "enqueue", str(src), "--job", "ctx", "--batch-size", "10")
    assert res.returncode == 0, res.stderr
    assert "quarantined 1 bad row" in res.stderr and TOO_LONG in res.stderr, res.stderr
    staged = load_batch_input(LocalStore(local_root(fleet_env)), "ctx", 0)
    assert staged[1].error.startswith(TOO_LONG) and "at least 8,189 tokens" in staged[1].error
    assert "a bound" in staged[1].error and "under 8,188 (context 8,192" in staged[1].error
    assert staged[0].error is None and staged[2].error is None
    make_workers([0])
    st = wait_done(fleet_env, "ctx")
    assert (st["completed"], st["failed"], st["quarantined"]) == (1, 0, 2), st
    rows = {x["id"]: x for x in decode_rows(
        LocalStore(local_root(fleet_env)).get(result_key("ctx", 0)))}
    assert rows["long"]["error"].startswith(ENGINE_REJECTED)
    assert "longer than the model's context length" in rows["long"]["error"]
    assert row_bucket(rows["long"]) == row_bucket(rows["huge"]) == "quarantined"


def test_with_the_models_tokenizer_rows_are_counted_exactly(fleet_env, r, tmp_path) -> None:
    """Item 2: a profile whose model folder holds a tokenizer counts with it (a 300-byte
    prompt is far under the bound, but over a 64-token context by the tokenizer)."""
    profile = tmp_path / "tiny.toml"
    profile.write_text(f'name = "tiny"\n[flags]\nmodel-path = "{TOKENIZER}"\n'
                       'context-length = 64\n')
    env = {**fleet_env, "FLEET_PROFILE": str(profile)}
    text = " ".join(f"def f{i}(x): return x" for i in range(20))
    src = _jsonl(tmp_path / "in.jsonl", [
        {"id": "short", "prompt": "def f(x): return x"}, {"id": "long", "prompt": text},
        {"id": "chat", "messages": [{"role": "user", "content": text}]}])
    res = cli(env, "enqueue", str(src), "--job", "tok", "--batch-size", "10")
    assert res.returncode == 0, res.stderr
    staged = load_batch_input(LocalStore(local_root(env)), "tok", 0)
    assert staged[0].error is None
    for row in staged[1:]:
        assert row.error.startswith(TOO_LONG) and "the model's tokenizer" in row.error, row
        assert "and the engine takes under 64 (context 64)" in row.error
    assert "PyTorch was not found" not in res.stderr


def test_the_bound_is_never_harsher_than_a_tokenizer_it_knows() -> None:
    """Item 2: the bound takes a token to span at most MAX_TOKEN_BYTES bytes; the test
    tokenizer's longest token spans fewer, so the bound never quarantines what it would take."""
    from tokenizers.decoders import ByteLevel

    from producer.context_limit import MAX_TOKEN_BYTES
    from producer.exports.engine_tokens import auto_tokenizer_class

    vocab = auto_tokenizer_class().from_pretrained(str(TOKENIZER)).get_vocab()
    longest = max(len(ByteLevel().decode([t]).encode()) for t in vocab)
    assert 0 < longest <= MAX_TOKEN_BYTES


def test_loading_the_tokenizer_prints_no_pytorch_notice() -> None:
    """Item 9: the tokens export's tokenizer loads without transformers' "PyTorch was not
    found" advice (this environment has no PyTorch, as the export extra installs none)."""
    import importlib.util

    assert importlib.util.find_spec("torch") is None  # else transformers would not say it
    code = ("from pathlib import Path; from producer.exports.engine_tokens import "
            f"EngineTokens; EngineTokens(Path({str(TOKENIZER)!r}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMERS_")}
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "PyTorch was not found" not in res.stderr, res.stderr
    bare = subprocess.run([sys.executable, "-c", "import transformers"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert "PyTorch was not found" in bare.stderr  # what the export silences


def test_enqueue_output_starts_with_its_first_line_and_counts_in_words(fleet_env, r,
                                                                        tmp_path) -> None:
    """Item 14: piped, no blank first line; "1 batch", "1 row"."""
    src = write_prompts(tmp_path / "p.jsonl", 2)
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "one")
    assert res.returncode == 0, res.stderr
    assert res.stderr.startswith("job one created: 2 prompts in 1 batch of "), repr(res.stderr)
    from producer.render import plural

    assert [plural(n, w) for n, w in ((1, "batch"), (2, "batch"), (1, "row"), (1_000, "row"))] \
        == ["1 batch", "2 batches", "1 row", "1,000 rows"]


def test_a_file_that_is_not_utf8_is_named_with_the_byte_and_its_offset(fleet_env, r,
                                                                        tmp_path) -> None:
    """Item 14: a Latin-1 line: one line naming the file, the line, the byte and its offset,
    not "str is not valid UTF-8: surrogates ..."; nothing staged."""
    first = orjson.dumps({"prompt": "fine"}) + b"\n"
    src = tmp_path / "latin1.jsonl"
    src.write_bytes(first + '{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    res = cli(fleet_env, "enqueue", str(src), "--job", "enc")
    assert res.returncode == 2
    offset = len(first) + len(b'{"prompt": "caf')
    assert res.stderr.strip() == (
        f"error: {src}:2: not UTF-8: byte 0xe9 at byte offset {offset} of the file "
        "(column 16 of the line); JSONL must be UTF-8 (re-encode it, e.g. iconv -f latin1 -t "
        "utf-8)"), res.stderr
    assert not (local_root(fleet_env) / "jobs" / "enc").exists()


def test_a_second_job_from_the_same_rows_offers_reuse_from(fleet_env, make_workers, r,
                                                           tmp_path) -> None:
    """Item 15: the same file under another name prints one line naming the job that
    answered its rows and ``--reuse-from`` it; run again with it, the rows are copied."""
    make_workers([0])
    src = write_prompts(tmp_path / "p.jsonl", 20)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "first", "--batch-size",
                        "10").returncode == 0
    wait_done(fleet_env, "first")
    other = write_prompts(tmp_path / "other.jsonl", 20, start=100)
    res = run_producer(fleet_env, "enqueue", str(other), "--job", "unrelated")
    assert res.returncode == 0 and "--reuse-from" not in res.stderr, res.stderr
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "second", "--batch-size", "10")
    assert res.returncode == 0, res.stderr
    lines = [x for x in res.stderr.splitlines() if "--reuse-from" in x]
    assert lines == [f"the rows of {src} were already answered in job first (20 completed): "
                     "run this enqueue again with --reuse-from first to copy those with the "
                     "same prompt, sampling and profile instead of generating them again"]
    again = run_producer(fleet_env, "enqueue", str(src), "--job", "third", "--batch-size",
                         "10", "--reuse-from", "first")
    assert again.returncode == 0 and "reused 20 rows from job first" in again.stderr, \
        again.stderr
    assert "already answered" not in again.stderr


def test_a_refused_enqueue_leaves_nothing_in_the_store_nor_in_redis(fleet_env, r,
                                                                     tmp_path) -> None:
    """Item 3: ``--keep-columns nosuchcol`` exits 2 with no folder of the job left (not even
    an empty one) and no Redis key (FLEET_PROFILE's record waits until the job is staged)."""
    src = write_prompts(tmp_path / "p.jsonl", 30)
    res = cli(fleet_env, "enqueue", str(src), "--job", "b-keep", "--keep-columns", "nosuchcol",
              "--batch-size", "10")
    assert res.returncode == 2 and "no row has the column 'nosuchcol'" in res.stderr
    assert not (local_root(fleet_env) / "jobs" / "b-keep").exists()
    assert "FLEET_PROFILE" in fleet_env and not r.keys("fleet:job:b-keep*")
    assert cli(fleet_env, "enqueue", str(src), "--job", "b-keep", "--batch-size",
               "10").returncode == 0
    assert r.hget("fleet:job:b-keep", "profile") == fleet_env["FLEET_PROFILE"].encode()


def test_the_bound_counts_a_chat_rows_content_bytes() -> None:
    """Item 2: a chat row's bound is its contents' UTF-8 bytes (2 for each 'é'), not the
    JSON around them; a row under the bound is left to the engine."""
    from producer.context_limit import ContextLimit

    limit = ContextLimit(8192, 4, "a bound")

    def row(chars: int) -> dict:
        return {"index": 0, "id": "c", "messages": [{"role": "user", "content": "é" * chars}]}

    over, under = row(8188 * 128), row(8188 * 128 - 200)
    limit.mark([over, under])
    assert over["error"].startswith(TOO_LONG) and "at least 8,188 tokens" in over["error"]
    assert "error" not in under
