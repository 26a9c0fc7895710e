"""Issue 42: the ``tokens`` export against SpecForge's own preprocessing of the same rows.

A data set of N (prompt, sample) rows is built as the fleet builds one: staged input
(``producer.enqueue.stage``), per-batch results as a worker stores them, the sink's
``aggregate``. Each row is a chat of ~300 characters with a ~900-character reasoning and a
~1,500-character answer of random words, and ``output_ids`` that are the answer's own
tokenization (as the engine's are). Then, in one run: ``export(... "tokens")`` in this process
(best of two), and SpecForge 0.2.0's own preprocessing of the same conversations in the
trainers venv (``tools/trainers_venv.sh``): ``specforge/data/preprocessing.py::
build_eagle3_dataset`` with its ``qwen3-thinking`` template and one process (``num_proc=1``),
timed inside that process after its imports (best of two). Goal: tokens <= 1.0 x SpecForge's
time. The old goal (tokens <= 2 x the JSONL export) is retired: the tokenizer alone costs more.

The tokenizer matters: both sides' cost is mostly the tokenizer's, per token. The goal is
measured with a byte-level BPE trained here on the bench's own text (the fixture's chat
template; 4.5k vocabulary; its chars per token are printed).

``python -m bench.exports [--rows 20000]``
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, Goal, _corpus, note, verdict
from producer.enqueue import EnqueueReport, stage
from producer.exports import export
from workers.dataset.jobs import JobSpec, SamplingSpec, encode_rows, result_key, save_spec
from workers.dataset.sink import ShardLimits, aggregate
from workers.dataset.store import LocalStore

TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer"
BATCH = 5_000
SPECFORGE = r"""
import json, sys, time
from datasets import load_dataset
from transformers import AutoTokenizer
from specforge.data.preprocessing import build_eagle3_dataset

tok = AutoTokenizer.from_pretrained(sys.argv[1])
ds = load_dataset("json", data_files=sys.argv[2], split="train", cache_dir=sys.argv[3])
best = float("inf")
for _ in range(2):
    t0 = time.perf_counter()
    out = build_eagle3_dataset(ds, tok, chat_template="qwen3-thinking", max_length=8192,
                               num_proc=1)
    best = min(best, time.perf_counter() - t0)
print("RESULT " + json.dumps({"s": best, "rows": len(out)}))
"""
BENCH_VOCAB = 4_500  # the vocabulary of the bench tokenizer (its chars per token are printed)


def bench_tokenizer(folder: Path, corpus: str) -> Path:
    """A byte-level BPE trained on ``corpus``, with the fixture tokenizer's chat template and
    special tokens, written as a model folder."""
    import json
    import shutil

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BENCH_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus[i:i + 10_000] for i in range(0, len(corpus), 10_000)],
                            trainer=trainer)
    config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    added = sorted(config["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))
    tok.add_special_tokens([AddedToken(v["content"], special=True, normalized=False)
                            for _, v in added if v["special"]])
    tok.add_tokens([AddedToken(v["content"], special=False, normalized=False)
                    for _, v in added if not v["special"]])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config.pop("added_tokens_decoder")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(TOKENIZER / "config.json", folder / "config.json")
    return folder


def chars_per_token(folder: Path, corpus: str) -> float:
    """Characters per token of ``folder``'s tokenizer on a slice of ``corpus``."""
    from tokenizers import Tokenizer

    text = corpus[:200_000]
    return len(text) / len(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids)


def _words(rng: random.Random, corpus: str, chars: int) -> str:
    start = rng.randrange(0, len(corpus) - chars - 1)
    return corpus[start:start + chars]


def build(store: LocalStore, job: str, rows: int, corpus: str, tokenizer: Path) -> None:
    """Stage ``rows`` chat prompts, store a result per row (its ``output_ids`` the answer's
    tokens under ``tokenizer``), run the sink."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    rng = random.Random(34)
    staged = [{"index": i, "id": f"r{i}",
               "messages": [{"role": "user", "content": _words(rng, corpus, 300)}]}
              for i in range(rows)]
    report = EnqueueReport(spec=None, created=True)  # type: ignore[arg-type]
    total, n, fingerprint = stage(store, job, staged, BATCH, report, False)
    spec = JobSpec(name=job, total=total, batch_size=BATCH, n_batches=n,
                   input_path="bench.jsonl", input_fingerprint=fingerprint,
                   sampling=SamplingSpec(max_new_tokens=2048, temperature=0.6),
                   input_sha256=report.batch_sha256)
    save_spec(store, spec)
    for b in range(n):
        got = []
        for i in range(b * BATCH, min(rows, (b + 1) * BATCH)):
            answer, reasoning = _words(rng, corpus, 1500), _words(rng, corpus, 900)
            ids = tok.encode(f"<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>",
                             add_special_tokens=False).ids
            got.append({
                "job": job, "batch": b, "index": i, "sample": 0, "id": f"r{i}", "prompt": None,
                "messages": staged[i]["messages"], "completion": answer,
                "reasoning": reasoning, "finish_reason": "stop", "status": "ok",
                "error": None, "prompt_tokens": 0, "completion_tokens": len(ids),
                "latency_s": 1.0, "profile": "qwen36-27b", "gpu": 0, "node": "bench",
                "output_ids": ids,
                "finished_at": 1.0})
        store.put(result_key(job, b), encode_rows(got, compress=False))
    aggregate(store, job, ShardLimits())


def timed(store: LocalStore, job: str, out: Path, tokenizer: Path, runs: int = 2
          ) -> tuple[float, dict]:
    """The fastest of ``runs`` runs of the tokens export, and what it wrote."""
    best, done = float("inf"), {}
    for _ in range(runs):
        t0 = time.perf_counter()
        done = export(store, job, "tokens", out, tokenizer)
        best = min(best, time.perf_counter() - t0)
    return best, done


def specforge_seconds(tmp: Path, tokenizer: Path) -> tuple[float, int]:
    """SpecForge's preprocessing of the same rows as conversations (each row's messages and
    its generated turn), in the trainers venv: (best seconds, rows)."""
    import json

    import pyarrow.parquet as pq

    from tests.test_export_loaders import trainers_python

    conv = tmp / "conversations.jsonl"
    data = pq.read_table(next((tmp / "store" / "jobs" / "bench" / "data").rglob("*.parquet")))
    with conv.open("w") as fh:
        for rows in data.to_batches(10_000):
            for r in rows.to_pylist():
                fh.write(json.dumps({"id": r["id"], "conversations": [
                    *r["messages"], {"role": "assistant", "content": r["completion"],
                                     "reasoning_content": r["reasoning"]}]}) + "\n")
    res = subprocess.run([str(trainers_python()), "-c", SPECFORGE, str(tokenizer), str(conv),
                          str(tmp / "hf-cache")], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    got = json.loads(res.stdout.split("RESULT ", 1)[1])
    return float(got["s"]), int(got["rows"])


def main(argv: list[str] | None = None) -> int:
    """Build the data set, time both, print the ratio beside its goal."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=20_000)
    args = parser.parse_args(argv)
    corpus = _corpus(random.Random(34), 400_000)
    with tempfile.TemporaryDirectory(prefix="bench-exports-") as tmp_name:
        tmp = Path(tmp_name)
        store = LocalStore(tmp / "store")
        trained = bench_tokenizer(tmp / "tokenizer", corpus)
        note(f"chars per token: bench tokenizer {chars_per_token(trained, corpus):.2f}")
        t0 = time.perf_counter()
        build(store, "bench", args.rows, corpus, trained)
        note(f"data set of {args.rows:,} rows built in {time.perf_counter() - t0:.1f} s")
        tokens_s, tokens = timed(store, "bench", tmp / "out.parquet", trained)
        note(f"tokens export: {tokens_s:.2f} s, {tokens['lines']:,} rows "
             f"(ok {tokens['ok']:,} + errors {tokens['errors']:,} = {tokens['rows']:,}; "
             f"{tokens['differ']:,} of {tokens['compared']:,} differ from the engine's ids)")
        sf_s, sf_rows = specforge_seconds(tmp, trained)
        note(f"SpecForge build_eagle3_dataset: {sf_s:.2f} s, {sf_rows:,} rows")
    return verdict("bench.exports (issue 42)", [
        Goal(f"tokens export / SpecForge's preprocessing, {args.rows:,} rows",
             tokens_s / sf_s, 1.0, "x", at_most=True)])


if __name__ == "__main__":
    raise SystemExit(main())
