"""Issue 34: the ``tokens`` export against the JSONL export of the same data set.

A data set of N (prompt, sample) rows is built as the fleet builds one: staged input
(``producer.enqueue.stage``), per-batch results as a worker stores them, the sink's
``aggregate``. Each row is a chat of ~300 characters with a ~900-character reasoning and a
~1,500-character answer of random words, and ``output_ids`` of one id per four characters (as
a worker stores the engine's). Then, in one process and one run, ``export(... "jsonl")`` and
``export(... "tokens")`` each run twice, the faster run counted. Goal: tokens <= 2 x the
JSONL export's wall time.

The tokenizer matters: the cost of the tokens export is mostly the tokenizer's, per token
(the fast tokenizer's ``encode_batch``). The goal is measured with a byte-level BPE trained
here on the bench's own text (as ``make_models.py`` trains the fixture's; the fixture's chat
template; 4.5k vocabulary, ~2.8 characters per token on this random-word text, where a real
model's tokenizer gives ~4 on English prose); the figure with the fixture tokenizer itself
(``tests/fixtures/tokenizer``: 4k vocabulary trained on Python source, ~1.5 characters per
token here) is printed beside it, not as a goal. Both chars-per-token figures are measured.

``python -m bench.exports [--rows 100000]``
"""

from __future__ import annotations

import argparse
import random
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


def build(store: LocalStore, job: str, rows: int, corpus: str) -> None:
    """Stage ``rows`` chat prompts, store a result per row, run the sink."""
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
            got.append({
                "job": job, "batch": b, "index": i, "sample": 0, "id": f"r{i}", "prompt": None,
                "messages": staged[i]["messages"], "completion": answer,
                "reasoning": reasoning, "finish_reason": "stop", "status": "ok",
                "error": None, "prompt_tokens": 80, "completion_tokens": 600,
                "latency_s": 1.0, "profile": "qwen36-27b", "gpu": 0, "node": "bench",
                "output_ids": [rng.randrange(4000) for _ in range(600)],
                "finished_at": 1.0})
        store.put(result_key(job, b), encode_rows(got, compress=False))
    aggregate(store, job, ShardLimits())


def timed(store: LocalStore, job: str, fmt: str, out: Path, tokenizer: Path | None = None,
          runs: int = 2) -> tuple[float, dict]:
    """The fastest of ``runs`` runs of one export, and what it wrote."""
    best, done = float("inf"), {}
    for _ in range(runs):
        t0 = time.perf_counter()
        done = export(store, job, fmt, out, tokenizer)
        best = min(best, time.perf_counter() - t0)
    return best, done


def main(argv: list[str] | None = None) -> int:
    """Build the data set, time both exports, print the ratio beside its goal."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args(argv)
    corpus = _corpus(random.Random(34), 400_000)
    with tempfile.TemporaryDirectory(prefix="bench-exports-") as tmp:
        store = LocalStore(Path(tmp) / "store")
        t0 = time.perf_counter()
        build(store, "bench", args.rows, corpus)
        note(f"data set of {args.rows:,} rows built in {time.perf_counter() - t0:.1f} s")
        trained = bench_tokenizer(Path(tmp) / "tokenizer", corpus)
        cpt = {"bench": chars_per_token(trained, corpus),
               "fixture": chars_per_token(TOKENIZER, corpus)}
        note(f"chars per token: bench tokenizer {cpt['bench']:.2f}, "
             f"fixture tokenizer {cpt['fixture']:.2f}")
        jsonl_s, jsonl = timed(store, "bench", "jsonl", Path(tmp) / "out.jsonl")
        note(f"jsonl:  {jsonl_s:.2f} s, {jsonl['lines']:,} lines")
        tokens_s, tokens = timed(store, "bench", "tokens", Path(tmp) / "out.parquet", trained)
        note(f"tokens: {tokens_s:.2f} s, {tokens['lines']:,} rows "
             f"(ok {tokens['ok']:,} + errors {tokens['errors']:,} = {tokens['rows']:,})")
        fixture_s, _ = timed(store, "bench", "tokens", Path(tmp) / "out.parquet", TOKENIZER,
                             runs=1)
        note(f"tokens with the fixture tokenizer ({cpt['fixture']:.2f} chars/token): "
             f"{fixture_s:.2f} s = {fixture_s / jsonl_s:.1f} x the JSONL export (not a goal)")
    return verdict("bench.exports (issue 34)", [
        Goal(f"tokens export / JSONL export, {args.rows:,} rows, "
             f"{cpt['bench']:.1f} chars/token", tokens_s / jsonl_s, 2.0, "x", at_most=True)])


if __name__ == "__main__":
    raise SystemExit(main())
