"""``fleet export --format specforge | speculators | tokens | hf``: the data set in a drafter
trainer's hands, token for token.

Every row kind (tests/trainer_rows.py) under five chat templates: the token exports give the
context the engine was sent, then the ids it generated, with the mask over exactly those; a
row whose ids or prompt length disagree with the engine's is counted and, past --max-differ,
the export exits 1 naming rows. Kept columns reach every export; --usable-only and
--train-input-turns; the hf folder's card. SpecForge's and speculators' own code reading these
files is tests/test_export_loaders.py.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from tests.test_sink import cli, fake_result, local_root, prompt_rows
from tests.trainer_rows import TEMPLATES, make_trainer_job, tokenizer_folder
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


def test_specforge_export(fleet_env, tmp_path, r, tok):
    _job(fleet_env, tok)
    out = tmp_path / "sf.jsonl"
    res = cli(fleet_env, "export", "--job", "tr", "--format", "specforge", "--out", str(out))
    assert res.returncode == 3 and "pass --tokenizer PATH" in res.stderr  # no model folder
    args = ("export", "--job", "tr", "--format", "specforge", "--tokenizer", str(TOKENIZER),
            "--max-differ", "1")  # the fake rows' prompt_tokens are not the tokenizer's
    res = cli(fleet_env, *args, "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "ok 10 + errors 2 = 12 rows" in res.stderr and "sf.jsonl.errors.jsonl" in res.stderr
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert len(lines) == 10 and len({x["id"] for x in lines}) == 10
    assert all(len(x["input_ids"]) == len(x["loss_mask"]) for x in lines)
    by_input = {x["input_id"]: x for x in lines}
    chat = by_input["p0"]["conversations"]
    assert chat == [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi 0"},
                    {"role": "assistant", "content": "answer to p0",
                     "reasoning_content": "thinking"}]
    # The engine's own ids are the supervised span where they were stored.
    p0 = by_input["p0"]
    assert [i for i, m in zip(p0["input_ids"], p0["loss_mask"], strict=True) if m] == \
        _answer_ids(tok, "thinking", "answer to p0")
    # A plain prompt went to /generate as it is: no system prompt was sent with it.
    assert by_input["p1"]["conversations"][0] == {"role": "user", "content": "Question 1: why?"}
    assert by_input["p2"]["conversations"][-1]["tool_calls"] == CALL
    errors = [orjson.loads(x) for x in (tmp_path / "sf.jsonl.errors.jsonl").read_bytes()
              .splitlines()]
    assert {(e["input_id"], e["bucket"]) for e in errors} == {("p5", "failed"),
                                                             ("p7", "quarantined")}
    assert all(e["error"] for e in errors)
    ds = datasets.load_dataset("json", data_files=str(out), split="train",
                               cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == 10 and {"input_ids", "loss_mask"} <= set(ds.column_names)
    again = tmp_path / "again.jsonl"
    cli(fleet_env, *args, "--out", str(again))
    assert again.read_bytes() == out.read_bytes()  # stable ids, same order


def _exported(path: Path, fmt: str) -> dict[tuple[str, int], dict]:
    """The rows of a token export by (input id, sample)."""
    if fmt == "tokens":
        return {(x["input_id"], x["sample"]): x for x in pq.read_table(path).to_pylist()}
    rows = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    if fmt == "speculators":
        return {(x["metadata"]["input_id"], x["metadata"]["sample"]): x for x in rows}
    return {(x["input_id"], x["sample"]): x for x in rows}


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_every_row_kind_is_the_engine_s_tokens_under_every_template(fleet_env, tmp_path, r,
                                                                    template):
    """specforge, speculators and tokens give, for every row kind, the context the engine was
    sent then the ids it generated, with the mask over exactly those: no template system
    prompt the engine was not sent, no re-serialized tool call, the ``<think>\\n`` a template
    primed as context, no newline after the end token, the engine's ids over the text's."""
    folder = tokenizer_folder(tmp_path, template)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    truth = make_trainer_job(fleet_env, tok)
    assert cli(fleet_env, "sink", "--job", "kinds", "--local").returncode == 0
    got = {}
    for fmt in ("specforge", "speculators", "tokens"):
        out = tmp_path / f"{template}.{fmt}"
        res = cli(fleet_env, "export", "--job", "kinds", "--format", fmt, "--out", str(out),
                  "--tokenizer", str(folder), "--max-differ", "0.2")
        assert res.returncode == 0, res.stderr
        assert "ok 16 + errors 0 = 16 rows" in res.stderr
        # Only the answer whose ids are not its text's canonical tokenization differs.
        assert "2 of 16 rows compared" in res.stderr, res.stderr
        got[fmt] = _exported(out, fmt)
        for k, (ids, mask) in truth.items():
            assert got[fmt][k]["input_ids"] == ids, (fmt, k)
            assert got[fmt][k]["loss_mask"] == mask, (fmt, k)
    assert {k for k, x in got["tokens"].items() if x["differs"]} == {("multi-turn", 0),
                                                                      ("multi-turn", 1)}
    spec_row = got["speculators"][("tool-call", 1)]
    assert spec_row["id"] == f"{spec_row['primary_id']}_gen1"
    assert spec_row["text"] == tok.decode(spec_row["input_ids"], skip_special_tokens=False)
    assert got["speculators"][("tool-call", 0)]["primary_id"] == spec_row["primary_id"]
    res = cli(fleet_env, "export", "--job", "kinds", "--format", "speculators", "--out",
              str(tmp_path / "strict.jsonl"), "--tokenizer", str(folder))
    assert res.returncode == 1 and "2 of 16 rows differ" in res.stderr
    assert "multi-turn" in res.stderr  # the rows are named


def _kept_of(path: Path, fmt: str) -> list[dict]:
    """The kept columns of every row of one export."""
    if fmt in ("parquet", "tokens"):
        rows = pq.read_table(path).to_pylist()
    elif fmt == "hf":
        rows = datasets.load_dataset(str(path), split="train").to_list()
    else:
        rows = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    if fmt in ("openai-batch", "specforge", "speculators"):
        return [x["columns"] for x in rows]
    return [{"topic": x["topic"], "score": x["score"]} for x in rows]


def test_every_export_keeps_the_kept_columns(fleet_env, tmp_path, r):
    from producer.exports import FORMATS

    folder = tokenizer_folder(tmp_path, "fixture")
    make_trainer_job(fleet_env, transformers.AutoTokenizer.from_pretrained(str(folder)))
    assert cli(fleet_env, "sink", "--job", "kinds", "--local").returncode == 0
    for fmt, form in FORMATS.items():
        out = tmp_path / f"out-{fmt}"
        extra = ["--tokenizer", str(folder), "--max-differ", "0.2"] if form.tokens else []
        res = cli(fleet_env, "export", "--job", "kinds", "--format", fmt, "--out", str(out),
                  *extra)
        assert res.returncode == 0, (fmt, res.stderr)
        kept = _kept_of(out, fmt)
        assert kept and all(k["topic"].startswith("topic of ") and isinstance(k["score"], int)
                            for k in kept), fmt
        # These rows fail the job's gates (16 alike answers, 2 truncated of 16): every export
        # says so in one line, and the hf card states the verdict verify gives.
        assert "this data set failed its gates at commit (fleet verify exits 5)" in res.stderr
    verify = cli(fleet_env, "verify", "--job", "kinds")
    assert verify.returncode == 5
    card = (tmp_path / "out-hf" / "README.md").read_text()
    assert "license: other" in card and "verify fails (exit 5): quality gates failed" in card
    res = cli(fleet_env, "export", "--job", "kinds", "--format", "hf", "--out",
              str(tmp_path / "lic"), "--license", "apache-2.0")
    assert res.returncode == 0 and "license: apache-2.0" in (tmp_path / "lic" / "README.md"
                                                             ).read_text()


def test_an_export_with_another_model_s_tokenizer_fails_naming_rows(fleet_env, tmp_path, r):
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_folder(tmp_path, "fixture")))
    make_trainer_job(fleet_env, tok)
    assert cli(fleet_env, "sink", "--job", "kinds", "--local").returncode == 0
    other = tokenizer_folder(tmp_path, "default_system")
    res = cli(fleet_env, "export", "--job", "kinds", "--format", "tokens", "--out",
              str(tmp_path / "t.parquet"), "--tokenizer", str(other))
    assert res.returncode == 1, res.stderr
    assert "is --tokenizer the job's model?" in res.stderr and "context" in res.stderr


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
    them with the fixture tokenizer's (the simulator's ids and prompt counts are not that
    tokenizer's, so every row differs: the export is written, says so and exits 1)."""
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
    assert res.returncode == 1, res.stderr
    assert "ok 16 + errors 0 = 16 rows" in res.stderr and out.exists()
    assert "16 of 16 rows differ from what the engine reported" in res.stderr
    data = pq.read_table(next((local_root(fleet_env) / "jobs" / "e2e" / "data").rglob(
        "*.parquet"))).to_pylist()
    assert all(row["output_ids"] and len(row["output_ids"]) == row["completion_tokens"]
               for row in data)


def test_usable_only_leaves_out_the_rows_a_row_level_gate_fails(fleet_env, tmp_path, r):
    """The answers cut at max_tokens go to the errors file with their reason; the rest (tool
    calls, thinking off, plain) are usable, and every row is accounted for."""
    folder = tokenizer_folder(tmp_path, "fixture")
    make_trainer_job(fleet_env, transformers.AutoTokenizer.from_pretrained(str(folder)))
    assert cli(fleet_env, "sink", "--job", "kinds", "--local").returncode == 0
    for fmt in ("specforge", "hf"):
        out = tmp_path / f"usable-{fmt}"
        extra = ["--tokenizer", str(folder), "--max-differ", "0.2"] if fmt == "specforge" else []
        res = cli(fleet_env, "export", "--job", "kinds", "--format", fmt, "--out", str(out),
                  "--usable-only", *extra)
        assert res.returncode == 0, res.stderr
        assert "ok 14 + errors 2 = 16 rows" in res.stderr
        errors = [orjson.loads(x) for x in (tmp_path / f"usable-{fmt}.errors.jsonl")
                  .read_bytes().splitlines()]
        assert {(e["input_id"], e["sample"], e["bucket"]) for e in errors} == {
            ("truncated", 0, "truncated"), ("truncated", 1, "truncated")}
        assert all("max_tokens" in e["error"] for e in errors)
    assert "--usable-only" in (tmp_path / "usable-hf" / "README.md").read_text()
    res = cli(fleet_env, "export", "--job", "kinds", "--format", "jsonl", "--out",
              str(tmp_path / "x.jsonl"), "--usable-only")
    assert res.returncode == 3 and "--usable-only applies to" in res.stderr


def test_train_input_turns_supervises_the_input_s_own_assistant_turns(fleet_env, tmp_path, r):
    """By default an input's earlier assistant turns are context (mask 0); asked, they are
    supervised from the text after their header through their end token, as SpecForge does."""
    folder = tokenizer_folder(tmp_path, "fixture")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    truth = make_trainer_job(fleet_env, tok)
    assert cli(fleet_env, "sink", "--job", "kinds", "--local").returncode == 0
    out = tmp_path / "turns.parquet"
    res = cli(fleet_env, "export", "--job", "kinds", "--format", "tokens", "--out", str(out),
              "--tokenizer", str(folder), "--max-differ", "0.2", "--train-input-turns")
    assert res.returncode == 0, res.stderr
    got = _exported(out, "tokens")
    head, end = "<|im_start|>assistant\n", "<|im_end|>"
    for key, (ids, mask) in truth.items():
        n_ctx = mask.index(1)
        text = tok.decode(ids[:n_ctx], skip_special_tokens=False)
        want = list(mask)
        at, prompt = text.find(head), text.rfind(head)  # the last: the generation prompt
        while 0 <= at < prompt:  # the context's own assistant turns
            start = at + len(head)
            stop = text.index(end, start) + len(end)
            a = len(tok.encode(text[:start], add_special_tokens=False))
            b = len(tok.encode(text[:stop], add_special_tokens=False))
            want[a:b] = [1] * (b - a)
            at = text.find(head, stop)
        assert got[key]["loss_mask"] == want, key
        assert (want != mask) == (key[0] in ("multi-turn", "tool-history")), key
