"""N samples per prompt and kept input columns (issue 27): units, bad input, one job end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from producer.keep import parse_keep
from producer.options import job_sampling
from tests.conftest import run_producer, wait_done
from workers.batch.prompt_sampling import sampling_for
from workers.dataset.jobs import JobSpec, PromptRow, SamplingSpec
from workers.dataset.samples import parse_unit_key, row_samples, sample_seed, unit_key
from workers.engine.sampling import SamplingError, translate
from workers.errors import InputError
from workers.redisdb.keys import JobKeys


def test_unit_keys_keep_a_one_sample_job_keyed_by_index() -> None:
    assert unit_key(12, 0) == "12" and unit_key(12, 3) == "12:3"
    assert parse_unit_key(b"12") == (12, 0) and parse_unit_key("12:3") == (12, 3)
    assert row_samples({"n": 5}, 2) == 5 and row_samples({}, 2) == 2 and row_samples(None, 1) == 1


def test_each_sample_gets_its_own_reproducible_seed() -> None:
    spec = JobSpec(name="j", total=1, batch_size=1, n_batches=1, input_path="x",
                   input_fingerprint="f",
                   sampling=SamplingSpec(samples=4, params={"sampling_seed": 7}))
    row = PromptRow(index=0, id="a", prompt="why?")
    seeds = [sampling_for(spec, row, s).extra["sampling_seed"] for s in range(4)]
    assert len(set(seeds)) == 4
    assert seeds == [sampling_for(spec, row, s).extra["sampling_seed"] for s in range(4)]
    assert seeds[1] == sample_seed(7, "why?", 1) != sample_seed(8, "why?", 1)
    # One sample: the row's own seed goes through untouched.
    one = spec.model_copy(update={"sampling": SamplingSpec(params={"sampling_seed": 7})})
    assert sampling_for(one, row).extra["sampling_seed"] == 7
    # A chat row's seed travels under OpenAI's name.
    chat = PromptRow(index=0, id="a", messages=[{"role": "user", "content": "hi"}])
    assert "seed" in sampling_for(spec, chat, 2).extra


def test_samples_are_checked_where_they_are_given() -> None:
    assert translate({"n": 4}, chat=True).samples == 4
    assert "n" not in translate({"n": 4}, chat=False).sampling  # never sent as such
    with pytest.raises(SamplingError, match="must be at least 1"):
        translate({"n": 0}, chat=False)
    assert job_sampling(temperature=0.7, sampling=["n=3"]).samples == 3
    with pytest.raises(InputError, match="temperature 0"):
        job_sampling(temperature=0.0, samples=4)
    with pytest.raises(InputError, match="at least 1"):
        job_sampling(samples=0)
    with pytest.raises(InputError, match="contradicts"):
        job_sampling(sampling=["n=2"], samples=3)
    with pytest.raises(InputError, match="'status' collides"):
        parse_keep("ref,status")
    assert parse_keep("*") == ["*"] and parse_keep(None) is None


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


@pytest.mark.parametrize(("rows", "args", "needle"), [
    ([{"prompt": "a"}], ["--samples", "0"], "at least 1"),
    ([{"prompt": "a"}], ["--samples", "4", "--temperature", "0"], "temperature 0"),
    ([{"custom_id": "c", "body": {"prompt": "a", "n": 4, "temperature": 0}}], [],
     "temperature 0"),
    ([{"prompt": "a", "status": 1}], ["--keep-columns", "status"], "'status' collides"),
    ([{"prompt": "a", "index": 1}], ["--keep-columns", "*"], "'index' collides"),
    ([{"custom_id": "t", "body": {"messages": [{"role": "user", "content": "x"}],
                                  "tools": {"type": "function"}}}], [],
     "'tools' must be a list of tool definitions"),
])
def test_bad_samples_and_kept_columns_get_one_line_and_exit_2(fleet_env, tmp_path, rows,
                                                              args, needle) -> None:
    src = _jsonl(tmp_path / "in.jsonl", rows)
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "bad", *args)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_samples_and_kept_columns_end_to_end(fleet_env, make_workers, tmp_path) -> None:
    """24 prompts x 3 samples, one with its own n = 5: every sample stored once, samples of a
    prompt differ, kept columns typed in Parquet and in every export."""
    rows: list[dict[str, Any]] = []
    for i in range(24):
        row: dict[str, Any] = {"id": f"q{i}", "prompt": f"Question {i}: what is {i} + {i}?",
                               "ref": 2 * i, "source": "gsm" if i % 2 else "math",
                               "mixed": i if i % 3 else f"s{i}"}
        rows.append(row)
    rows[5] = {"custom_id": "q5", "body": {"prompt": "Question 5 asked five times", "n": 5},
               "ref": 10, "source": "gsm", "mixed": 5}
    src = _jsonl(tmp_path / "in.jsonl", rows)
    make_workers([0])
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "s3", "--batch-size", "8",
                       "--samples", "3", "--temperature", "0.8", "--sampling", "seed=11",
                       "--max-new-tokens", "64", "--keep-columns", "ref,source,mixed")
    assert res.returncode == 0, res.stderr
    st = wait_done(fleet_env, "s3", timeout_s=120)
    expected = 23 * 3 + 5
    assert (st["total"], st["prompts"], st["samples_done"]) == (expected, 24, expected)
    assert st["prompts_done"] == 24
    res = run_producer(fleet_env, "verify", "--job", "s3", "--json")
    report = orjson.loads(res.stdout)
    assert res.returncode == 0, report
    assert report == {**report, "expected": expected, "prompts": 24, "samples": expected,
                      "duplicates": 0, "missing": 0, "ok": True}
    # Staged input: one row per prompt, its kept values once.
    store = Path(fleet_env["FLEET_STORE_URL"].removeprefix("file://"))
    from workers.dataset.jobs import decode_rows
    staged = [r for f in sorted((store / "jobs/s3/inputs").glob("*.gz"))
              for r in decode_rows(f.read_bytes())]
    assert len(staged) == 24 and staged[0]["keep"] == {"ref": 0, "source": "math",
                                                       "mixed": "s0"}
    res = run_producer(fleet_env, "sink", "--job", "s3", "--local")
    assert res.returncode == 0, res.stderr
    path = run_producer(fleet_env, "dataset-path", "--job", "s3").stdout.strip()
    table = pq.read_table(path)
    assert table.num_rows == expected
    assert table.schema.field("sample").type == pa.int32()
    assert table.schema.field("ref").type == pa.int64()
    assert table.schema.field("source").type == pa.string()
    assert table.schema.field("tool_calls").type == pa.string()
    data = table.to_pylist()
    assert sorted((r["index"], r["sample"]) for r in data) == sorted(
        {(i, s) for i in range(24) for s in range(5 if i == 5 else 3)})
    by_prompt: dict[int, list[dict[str, Any]]] = {}
    for r in data:
        by_prompt.setdefault(r["index"], []).append(r)
        assert r["ref"] == 2 * r["index"] and r["tool_calls"] is None
    # Samples of one prompt differ (each has its own seed): the sim draws each one's length.
    differ = sum(len({x["completion_tokens"] for x in v}) > 1 for v in by_prompt.values())
    assert differ >= 20, differ
    assert {r["mixed"] for r in by_prompt[1]} == {"1"} and by_prompt[0][0]["mixed"] == '"s0"'
    # Every export carries the kept columns, typed.
    for fmt in ("parquet", "jsonl", "openai-batch"):
        out = tmp_path / f"s3.{fmt}"
        res = run_producer(fleet_env, "export", "--job", "s3", "--format", fmt, "--out",
                           str(out))
        assert res.returncode == 0, res.stderr
        if fmt == "parquet":
            assert pq.read_table(out).schema.field("ref").type == pa.int64()
            continue
        lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
        if fmt == "jsonl":
            assert len(lines) == expected and lines[0]["ref"] == 0 and lines[0]["sample"] == 0
        else:  # one line per prompt, one choice per sample
            assert len(lines) == 24 and lines[5]["columns"]["ref"] == 10
            assert [c["index"] for c in lines[5]["response"]["body"]["choices"]] == list(range(5))


def _pool_children(pid: int) -> list[int]:
    """A worker's pool processes (its children other than the engine guard)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids
            if b"workers.engine.guard" not in Path(f"/proc/{k}/cmdline").read_bytes()]


def test_a_batch_killed_halfway_through_its_samples_stores_each_once(
        fleet_env, make_workers, tmp_path, r) -> None:
    """SIGKILL the pool process while a batch has some of its samples recorded: the
    redelivered batch sends only the rest, and every (prompt, sample) is stored once."""
    import os
    import signal
    import time


    src = _jsonl(tmp_path / "in.jsonl", [{"id": f"k{i}", "prompt": f"Kill test {i}", "ref": i}
                                         for i in range(8)])
    (worker,) = make_workers([0], FLEET_SIM_SPEED="1", FLEET_SIM_MEAN_OUTPUT_TOKENS="150",
                             FLEET_BATCHES_PER_GPU="1", FLEET_CLIENT_CONCURRENCY="4")
    res = run_producer(fleet_env, "enqueue", str(src), "--job", "half", "--batch-size", "8",
                       "--samples", "6", "--temperature", "0.9", "--keep-columns", "ref")
    assert res.returncode == 0, res.stderr
    # Answered samples reach the progress hash at each spill (every 5 s): the batch must run
    # longer than that for the kill to fall between its samples.
    progress = JobKeys("half").progress(0)
    deadline = time.monotonic() + 60
    while r.hlen(progress) < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    recorded = r.hlen(progress)
    assert 12 <= recorded < 48, recorded  # halfway through the batch's samples
    for pid in _pool_children(worker.proc.pid):
        os.kill(pid, signal.SIGKILL)
    wait_done(fleet_env, "half", timeout_s=120)
    report = orjson.loads(run_producer(fleet_env, "verify", "--job", "half", "--json").stdout)
    assert report == {**report, "expected": 48, "prompts": 8, "samples": 48, "rows": 48,
                      "duplicates": 0, "missing": 0, "ok": True}
    store = Path(fleet_env["FLEET_STORE_URL"].removeprefix("file://"))
    rows = [orjson.loads(x) for x in (store / "jobs/half/results/b000000.jsonl"
                                      ).read_bytes().splitlines()]
    assert sorted((x["index"], x["sample"]) for x in rows) == [(i, s) for i in range(8)
                                                              for s in range(6)]
    assert all(x["keep"] == {"ref": x["index"]} for x in rows)
    import re

    sent = [int(n) for n in re.findall(r"batch half/0 gpu=0 prompts=48 sent=(\d+)",
                                       worker.log_path.read_text())]
    assert len(sent) == 1 and sent[0] <= 48 - recorded, sent  # the rest only


def test_parquet_kept_columns_keep_their_arrow_types(tmp_path) -> None:
    """Kept Parquet columns come back in the data set with the input's Arrow types and values
    (read, staged as JSON, written by the sink's shard writer)."""
    import datetime as dt
    import decimal

    from producer.keep import KeepColumns
    from producer.readers import ReadOptions, read_rows
    from workers.dataset.jobs import decode_rows, encode_rows
    from workers.dataset.kept import decode_schema
    from workers.dataset.sink import ShardWriter

    when = dt.datetime(2026, 5, 1, 12, 30, tzinfo=dt.UTC)
    table = pa.table({
        "prompt": ["a", "b"],
        "score": pa.array([3, None], pa.int32()),
        "tags": pa.array([["x", "y"], []], pa.list_(pa.string())),
        "when": pa.array([when, when], pa.timestamp("us", tz="UTC")),
        "price": pa.array([decimal.Decimal("1.25"), decimal.Decimal("10.00")],
                          pa.decimal128(10, 2)),
        "meta": pa.array([{"k": 1}, {"k": 2}], pa.struct([("k", pa.int64())])),
    })
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    opts = ReadOptions()
    opts.keep = KeepColumns(["*"], fleet_columns=opts.columns())
    staged = decode_rows(encode_rows(list(read_rows(src, opts)), compress=True))
    types, encoded = opts.keep.record()
    assert types == {"score": "int32", "tags": "list<element: string>",
                     "when": "timestamp[us, tz=UTC]", "price": "decimal128(10, 2)",
                     "meta": "struct<k: int64>"}
    spec = JobSpec(name="k", total=2, batch_size=2, n_batches=1, input_path="x",
                   input_fingerprint="f", keep_columns=types, keep_schema=encoded)
    from workers.dataset.manifest import job_schema

    writer = ShardWriter(tmp_path / "part.parquet", job_schema(spec))
    results = [{"index": r["index"], "id": r["id"], "prompt": r["prompt"], "status": "ok",
                "keep": r["keep"]} for r in staged]
    writer.add(0, results, 100)
    writer.close()
    out = pq.read_table(tmp_path / "part.parquet")
    source = pq.read_schema(src)
    for name in types:
        assert out.schema.field(name).type == source.field(name).type, name
        assert out.column(name).to_pylist() == table.column(name).to_pylist(), name
    assert decode_schema(encoded).names == list(types)
