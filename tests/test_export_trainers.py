"""``fleet export --format specforge | tokens | hf``: the data set in a drafter trainer's hands.

The job's results are written as a worker writes them (tests.test_sink), with reasoning, tool
calls, the engine's ``output_ids`` (right for one row, wrong for another), a failed and a
quarantined row; the exports are then read back the way their trainers read them:
``datasets.load_dataset`` for JSONL, Parquet and the hf folder, SpecForge's conversation rules
and loss-mask arithmetic (``specforge/data/parse.py``, ``GeneralParser.parse``: the mask from
the assistant header through the end-of-turn token, token positions from the encoded length of
the text before each end), vLLM speculators' row keys (``scripts/response_regeneration``).
"""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from tests.test_sink import cli, fake_result, local_root, prompt_rows
from workers.dataset.jobs import PromptRow, SamplingSpec, load_batch_input, result_key
from workers.dataset.store import LocalStore

transformers = pytest.importorskip("transformers", reason="the export extra is not installed")
datasets = pytest.importorskip("datasets", reason="the export extra is not installed")

from tests.test_sink import make_job  # noqa: E402
from workers.dataset.jobs import encode_rows  # noqa: E402

TOKENIZER = Path(__file__).parent / "fixtures" / "tokenizer"
CALL = [{"id": "call_0", "type": "function",
         "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}]


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER))


def _answer_ids(tok, reasoning: str, content: str) -> list[int]:
    return tok.encode(f"<think>\n{reasoning}\n</think>\n\n{content}<|im_end|>",
                      add_special_tokens=False)


def _job(fleet_env, tok, name: str = "tr") -> LocalStore:
    store = LocalStore(local_root(fleet_env))
    rows = prompt_rows(12)
    rows[7] = PromptRow(index=7, id="p7", error="line 8: no 'prompt' or 'messages'")
    spec = make_job(store, name, rows, batch_size=6, missing=(0, 1),
                    sampling=SamplingSpec(max_new_tokens=64, system_prompt="Be brief."))
    for batch in range(spec.n_batches):
        got = []
        for row in load_batch_input(store, name, batch):
            rec = fake_result(spec, batch, row)
            if row.index == 0:  # the engine's ids, as the template tokenizes the answer
                rec["output_ids"] = _answer_ids(tok, "thinking", "answer to p0")
            if row.index == 2:
                rec.update(completion="", tool_calls=orjson.dumps(CALL).decode(),
                           finish_reason="tool_calls")
            if row.index == 4:
                rec["output_ids"] = [1, 2, 3]
            if row.index == 6:  # newlines that merge with the header's across the boundary
                rec.update(reasoning=None, completion="\n\n  indented answer")
            got.append(rec)
        store.put(result_key(name, batch), encode_rows(got, compress=False))
    res = cli(fleet_env, "sink", "--job", name, "--local")
    assert res.returncode == 0, res.stderr
    return store


def _specforge_order_ok(conv: list[dict]) -> bool:
    """SpecForge's GeneralParser.parse rules: an optional system message, then a user turn
    first; an assistant turn after a user or tool turn (otherwise it truncates)."""
    rest = conv[1:] if conv and conv[0]["role"] == "system" else conv
    if not rest or rest[0]["role"] != "user":
        return False
    return all(not (b["role"] == "assistant" and a["role"] not in ("user", "tool"))
               for a, b in zip(rest, rest[1:], strict=False))


def test_specforge_export(fleet_env, tmp_path, r, tok):
    _job(fleet_env, tok)
    out = tmp_path / "sf.jsonl"
    res = cli(fleet_env, "export", "--job", "tr", "--format", "specforge", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "ok 10 + errors 2 = 12 rows" in res.stderr and "sf.jsonl.errors.jsonl" in res.stderr
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert len(lines) == 10 and len({x["id"] for x in lines}) == 10
    by_input = {x["input_id"]: x for x in lines}
    chat = by_input["p0"]["conversations"]
    assert chat == [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi 0"},
                    {"role": "assistant", "content": "answer to p0",
                     "reasoning_content": "thinking"}]
    # A plain prompt went to /generate as it is: no system prompt was sent with it.
    assert by_input["p1"]["conversations"][0] == {"role": "user", "content": "Question 1: why?"}
    assert by_input["p2"]["conversations"][-1]["tool_calls"] == CALL
    assert all(_specforge_order_ok(x["conversations"]) for x in lines)
    errors = [orjson.loads(x) for x in (tmp_path / "sf.jsonl.errors.jsonl").read_bytes()
              .splitlines()]
    assert {(e["input_id"], e["bucket"]) for e in errors} == {("p5", "failed"),
                                                             ("p7", "quarantined")}
    assert all(e["error"] for e in errors)
    # datasets' JSON loader (what SpecForge's scripts load with) takes every line.
    ds = datasets.load_dataset("json", data_files=str(out), split="train",
                               cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == 10 and "conversations" in ds.column_names
    again = tmp_path / "again.jsonl"
    cli(fleet_env, "export", "--job", "tr", "--format", "specforge", "--out", str(again))
    assert again.read_bytes() == out.read_bytes()  # stable ids, same order


def _specforge_mask(tok, text: str) -> list[int]:
    """SpecForge's loss mask for the last assistant turn, computed its way (its registered
    ``qwen`` template: header ``<|im_start|>assistant\n``, end of turn ``<|im_end|>\n``)."""
    ids = tok(text, add_special_tokens=False).input_ids
    mask = [0] * len(ids)
    match = list(re.finditer(re.escape("<|im_start|>assistant\n") + r"([\s\S]*?(?:"
                             + re.escape("<|im_end|>\n") + "|$))", text))[-1]
    start = len(tok.encode(text[:match.start(1)], add_special_tokens=False))
    end = len(tok.encode(text[:match.end(1)], add_special_tokens=False))
    mask[start:end] = [1] * (end - start)
    return mask


def test_tokens_export(fleet_env, tmp_path, r, tok):
    _job(fleet_env, tok)
    out = tmp_path / "tok.parquet"
    res = cli(fleet_env, "export", "--job", "tr", "--format", "tokens", "--out", str(out))
    assert res.returncode == 3 and "pass --tokenizer PATH" in res.stderr  # no model folder
    res = cli(fleet_env, "export", "--job", "tr", "--format", "tokens", "--out", str(out),
              "--tokenizer", str(TOKENIZER))
    assert res.returncode == 0, res.stderr
    assert "ok 10 + errors 2 = 12 rows" in res.stderr
    assert "differs from the engine's output_ids in 1 of 2 rows" in res.stderr
    table = pq.read_table(out)
    rows = {x["input_id"]: x for x in table.to_pylist()}
    assert set(table.column_names) >= {"id", "primary_id", "input_ids", "loss_mask", "text"}
    for row in rows.values():
        assert len(row["input_ids"]) == len(row["loss_mask"])
        assert row["input_ids"] == tok(row["text"], add_special_tokens=False).input_ids
        assert row["loss_mask"] == _specforge_mask(tok, row["text"])
    p0 = rows["p0"]
    span = [i for i, m in zip(p0["input_ids"], p0["loss_mask"], strict=True) if m]
    assert span == _answer_ids(tok, "thinking", "answer to p0") + tok.encode("\n")
    assert p0["engine_ids_match"] is True and rows["p4"]["engine_ids_match"] is False
    assert rows["p6"]["engine_ids_match"] is None
    assert "<tool_call>" in rows["p2"]["text"]
    assert orjson.loads(p0["sampling"])["max_new_tokens"] == 64
    ds = datasets.load_dataset("parquet", data_files=str(out), split="train",
                               cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == 10


def test_hf_export_loads_with_datasets(fleet_env, tmp_path, r, tok):
    _job(fleet_env, tok)
    out = tmp_path / "hf"
    res = cli(fleet_env, "export", "--job", "tr", "--format", "hf", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "ok 10 + errors 2 = 12 rows" in res.stderr
    readme = (out / "README.md").read_text()
    assert readme.startswith("---\n") and "dataset_info:" in readme and "configs:" in readme
    assert "Qwen/Qwen3.6-27B" in readme and "max_new_tokens" in readme
    assert "1 failed and 1 quarantined" in readme
    assert sorted(p.name for p in (out / "data").iterdir()) == ["train-00000-of-00001.parquet"]
    ds = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "cache"))
    assert list(ds) == ["train"] and ds["train"].num_rows == 10
    assert ds["train"].features["conversations"].feature["reasoning_content"].dtype == "string"
    assert (tmp_path / "hf.errors.jsonl").exists()
    res = cli(fleet_env, "export", "--job", "tr", "--format", "hf", "--out", str(out))
    assert res.returncode == 0 and not list(tmp_path.glob(".hf*"))  # replaced, nothing left


def test_a_finished_job_reaches_the_trainer_with_the_engine_s_ids(fleet_env, make_workers,
                                                                   tmp_path, r):
    """A real worker and the simulated engine playing 0.5.23: every row stores the engine's
    ids (/generate's output_ids, chat's response_token_ids), and the tokens export compares
    them with the fixture tokenizer's span (the simulator's ids are not that tokenizer's, so
    every row differs: the count says so)."""
    from tests.conftest import run_producer, wait_done, write_prompts

    make_workers([0], FLEET_SIM_SGLANG_VERSION="0.5.23")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 16)
    res = run_producer(fleet_env, "enqueue", str(prompts), "--job", "e2e", "--batch-size", "8",
                       "--max-new-tokens", "24")
    assert res.returncode == 0, res.stderr
    assert wait_done(fleet_env, "e2e")["completed"] == 16
    assert cli(fleet_env, "sink", "--job", "e2e", "--local").returncode == 0
    out = tmp_path / "e2e.parquet"
    res = cli(fleet_env, "export", "--job", "e2e", "--format", "tokens", "--out", str(out),
              "--tokenizer", str(TOKENIZER))
    assert res.returncode == 0, res.stderr
    assert "ok 16 + errors 0 = 16 rows" in res.stderr
    assert "differs from the engine's output_ids in 16 of 16 rows" in res.stderr
    data = pq.read_table(next((local_root(fleet_env) / "jobs" / "e2e" / "data").rglob(
        "*.parquet"))).to_pylist()
    assert all(row["output_ids"] and len(row["output_ids"]) == row["completion_tokens"]
               for row in data)
