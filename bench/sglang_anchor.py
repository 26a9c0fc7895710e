"""SGLang's own ceiling for the GPU check: ``python -m sglang.bench_offline_throughput``.

The anchor is SGLang's offline benchmark CLI, run unchanged: its in-process ``Engine`` is
started with the fleet's launch flags (the profile, as the worker launches it, less host and
port), every row is handed to ``Engine.generate`` at once, and its output tokens/s is the
figure the fleet is measured against (``sglang_offline`` in the check's summary).

How the check's rows reach it. At 0.5.11 the CLI's ``--dataset-name`` is ``sharegpt``,
``random`` or ``generated-shared-prefix`` (``bench_offline_throughput.BenchArgs``); none of
them takes a per-row output length, and ``random`` draws lengths uniformly. ``sharegpt``
takes a local ``--dataset-path``: a JSON list of ``{"conversations": [{"from": "human",
"value": PROMPT}, {"from": "gpt", "value": COMPLETION}]}``, and SGLang's sampler
(``sglang.benchmark.datasets.sharegpt.sample_sharegpt_requests``) asks each row for
``len(tokenizer.encode(COMPLETION))`` new tokens. So the check writes one conversation per
row: the row's user message as the human turn (with ``--apply-chat-template`` the CLI wraps
it in the model's chat template, as the chat route does for the fleet), and as the gpt turn a
text that the model's tokenizer encodes to exactly the row's ``max_tokens`` (one piece
repeated; each length is checked with the same ``tokenizer.encode`` call the sampler makes).
``--num-prompts`` is the number of rows, so every row is taken once (the sampler shuffles
their order, not their lengths).

Sampling: the fleet's rows carry none, so SGLang applies the model's ``generation_config.json``
(temperature 0.6, top-p 0.95, top-k 20 for the stand-in): sampled, not greedy. The CLI sends
``temperature: 0`` unless told otherwise and merges ``--extra-request-body`` into each row's
``sampling_params``, so the check passes the model's own sampling there. ``ignore_eos`` stays
on (the CLI's default): with dummy weights EOS almost never comes, so the fleet's rows also run
to their ``max_tokens``.

The ratio the check reports (``fleet_ratio``) is the fleet job's decode tokens/s (the engine's
own counter, from the first running request until the last batch was stored) over the CLI's
output tokens/s (its generated tokens over its one ``Engine.generate`` call, warm-up excluded).

The CLI imports ``datasets`` at module import (``sglang.benchmark.datasets``) for datasets this
run never uses; where the package is missing (the lent GPU machine), a stand-in whose
``load_dataset`` raises is put last on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from config.launch_profile import LaunchProfile

# Pieces tried, in order, for the completion text: the first whose repetition the tokenizer
# encodes to exactly one token per piece is used.
PIECES = (" a", " x", " the", " 0", "!", " hello", ".", " b", "\n")
# The CLI's module: ``sglang.bench_offline_throughput`` in 0.5.11; 0.5.23 has it as
# ``sglang.benchmark.offline_throughput`` (same options, same result line).
MODULES = ("sglang.bench_offline_throughput", "sglang.benchmark.offline_throughput")
MODULE = MODULES[0]


def cli_module() -> str:
    """The installed release's module for the CLI (the first of MODULES it has)."""
    for name in MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ModuleNotFoundError:  # no sglang (or no sglang.benchmark) at all
            continue
    return MODULE


class AnchorError(RuntimeError):
    """The anchor could not be prepared (no tokenizer, no exact-length completion)."""


def row_lengths(rows: Sequence[dict[str, Any]], max_new: int) -> list[int]:
    """Each row's output length as the fleet asks for it: its own ``max_tokens`` under the
    job's ``--max-new-tokens``."""
    out = []
    for row in rows:
        body = row.get("body") or row
        out.append(min(int(body.get("max_tokens") or max_new), max_new))
    return out


def row_prompt(row: dict[str, Any]) -> str:
    """The row's user message (the chat rows the check writes have one)."""
    body = row.get("body") or row
    messages = body.get("messages") or [{"role": "user", "content": body.get("prompt", "")}]
    return "\n".join(str(m.get("content", "")) for m in messages if m.get("role") == "user")


def repeated_piece(encode: Callable[[str], list[int]], lengths: Sequence[int]) -> str:
    """A piece whose ``n``-fold repetition ``encode`` turns into exactly ``n`` tokens, for
    every ``n`` in ``lengths`` (and a few small ones)."""
    wanted = sorted({1, 2, 3, 17, *lengths})
    for piece in PIECES:
        if all(len(encode(piece * n)) == n for n in wanted):
            return piece
    raise AnchorError(f"no piece in {PIECES!r} encodes to one token per repetition")


def write_sharegpt(path: Path, rows: Sequence[dict[str, Any]], lengths: Sequence[int],
                   encode: Callable[[str], list[int]]) -> dict[str, Any]:
    """The rows as a ShareGPT-format JSON file whose gpt turns encode to ``lengths``."""
    if len(rows) != len(lengths):
        raise ValueError("one length per row")
    if min(lengths, default=2) < 2:  # SGLang's sampler drops output lengths under 2
        raise AnchorError("a row asks for fewer than 2 tokens: SGLang's sampler would drop it")
    piece = repeated_piece(encode, lengths)
    pairs = zip(rows, lengths, strict=True)
    data = [{"id": f"row-{i}", "conversations": [
        {"from": "human", "value": row_prompt(row)},
        {"from": "gpt", "value": piece * n}]} for i, (row, n) in enumerate(pairs)]
    path.write_text(json.dumps(data))
    return {"path": str(path), "rows": len(data), "piece": piece,
            "output_tokens": sum(lengths)}


def model_sampling(model_path: str | Path) -> dict[str, float | int]:
    """The sampling SGLang applies to a request that names none: the model folder's
    ``generation_config.json`` (temperature, top_p, top_k, min_p); {} when it has none."""
    path = Path(model_path) / "generation_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: cfg[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in cfg}


def command(python: str, profile_argv: Sequence[str], dataset: Path, n_rows: int,
            sampling: dict[str, Any], result: Path, seed: int = 1,
            module: str = MODULE) -> list[str]:
    """The CLI's command line: the launch flags, then its own benchmark flags."""
    return [python, "-m", module, *profile_argv,
            "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
            "--num-prompts", str(n_rows), "--apply-chat-template",
            "--extra-request-body", json.dumps(sampling),
            "--result-filename", str(result), "--seed", str(seed)]


def profile_argv(profile: LaunchProfile, version: str | None) -> list[str]:
    """The profile's flags as the worker launches them on this release (renamed flags under
    their new names), without host and port."""
    flags = profile.flags
    if version:
        from workers.engine.releases import engine_flags
        flags = engine_flags(version, flags)
    return profile.model_copy(update={"flags": flags}).to_argv()


def datasets_stub(folder: Path) -> Path | None:
    """A stand-in ``datasets`` package when the real one is missing (see the module doc)."""
    if importlib.util.find_spec("datasets") is not None:
        return None
    pkg = folder / "datasets-stub" / "datasets"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(
        '"""Stand-in: the real package is not installed here."""\n\n\n'
        "def load_dataset(*args, **kwargs):\n"
        "    raise RuntimeError('datasets is not installed here')\n")
    return pkg.parent


def read_result(result: Path) -> dict[str, Any]:
    """The CLI's ``--result-filename`` line (the last one)."""
    lines = [ln for ln in result.read_text().splitlines() if ln.strip()]
    return dict(json.loads(lines[-1]))


def run_anchor(profile: LaunchProfile, rows: Sequence[dict[str, Any]], max_new: int,
               workdir: Path, log_path: Path, timeout_s: float,
               version: str | None = None, seed: int = 1,
               encode: Callable[[str], list[int]] | None = None,
               python: str = sys.executable) -> dict[str, Any]:
    """Run the CLI on ``rows``; its figures, or ``error`` with the reason and the log's tail.
    ``encode`` defaults to the model's tokenizer as SGLang's sampler loads it."""
    model = str(profile.flag("tokenizer-path") or profile.flag("model-path"))
    lengths = row_lengths(rows, max_new)
    try:
        if encode is None:
            from transformers import AutoTokenizer  # SGLang's own dependency
            encode = AutoTokenizer.from_pretrained(model).encode
        dataset = write_sharegpt(workdir / "anchor-sharegpt.json", rows, lengths, encode)
    except (ImportError, OSError, AnchorError, ValueError) as exc:
        return {"error": f"anchor not prepared: {exc}"}
    sampling = model_sampling(model)
    result = workdir / "anchor-result.jsonl"
    argv = command(python, profile_argv(profile, version), Path(dataset["path"]),
                   len(rows), sampling, result, seed, cli_module())
    env = {**os.environ, **profile.env}
    stub = datasets_stub(workdir)
    if stub is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (env.get("PYTHONPATH"), str(stub))))
    t0 = time.monotonic()
    rc: int | None = None
    with log_path.open("w") as log:
        # Its own process group: the Engine's scheduler and detokenizer processes go with it
        # on a timeout or an interrupt of the check.
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):  # KeyboardInterrupt: the
            pass  # check's time limit (SIGINT); what the CLI wrote is still read below
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out: dict[str, Any] = {"command": [Path(argv[0]).name, *argv[1:]],
                           "dataset": {**dataset, "format": "sharegpt (local file)"},
                           "sampling": sampling or "SGLang's defaults",
                           "wall_s": round(time.monotonic() - t0, 1), "rc": rc}
    if rc is None and result.exists():
        # The CLI wrote its figures, then did not exit in time (its engine's shutdown).
        out["note"] = "killed after it wrote its result"
    elif rc != 0 or not result.exists():
        out["error"] = ("timed out" if rc is None else f"exit {rc}") + ": " + \
            log_path.read_text(errors="replace")[-1500:]
        return out
    res = read_result(result)
    out.update({"output_tok_s": round(float(res["output_throughput"]), 1),
                "seconds": round(float(res["total_latency"]), 1),
                "output_tokens": int(res["total_output_tokens"]),
                "requests": int(res["successful_requests"]),
                "asked_tokens": sum(lengths)})
    return out
