"""The GPU check's order control and its SGLang anchor (issue 29), without a GPU.

The anchor is SGLang's own ``bench_offline_throughput`` CLI; here a stand-in module of the same
name, put first on PYTHONPATH, reads the arguments and the ShareGPT-format file as the real CLI
does (``sample_sharegpt_requests``: output length = ``len(tokenizer.encode(gpt turn))``) and
writes the result line the real one writes with ``--result-filename``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import gpu_check
from bench.sglang_anchor import (
    AnchorError,
    command,
    datasets_stub,
    model_sampling,
    profile_argv,
    repeated_piece,
    row_lengths,
    run_anchor,
    write_sharegpt,
)
from config.launch_profile import load_profile


def words(text: str) -> list[int]:
    """A tokenizer stand-in: one token per whitespace-separated word."""
    return [hash(w) for w in text.split()]


def chat_rows(lengths: list[int]) -> list[dict]:
    return [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"max_tokens": n, "messages": [{"role": "user", "content": f"q {i}"}]}}
            for i, n in enumerate(lengths)]


def test_rows_become_sharegpt_conversations_of_their_exact_lengths(tmp_path: Path) -> None:
    rows = chat_rows([500, 37, 1200, 2])
    lengths = row_lengths(rows, 1000)  # --max-new-tokens caps a row's own max_tokens
    assert lengths == [500, 37, 1000, 2]
    info = write_sharegpt(tmp_path / "d.json", rows, lengths, words)
    data = json.loads((tmp_path / "d.json").read_text())
    assert info["rows"] == 4 and info["output_tokens"] == 1539
    assert [c["conversations"][0] for c in data][1] == {"from": "human", "value": "q 1"}
    assert [len(words(c["conversations"][1]["value"])) for c in data] == lengths


def test_a_piece_that_merges_is_skipped() -> None:
    # " a" repeated merges pairs here; " x" does not.
    def merging(text: str) -> list[int]:
        if text.startswith(" a"):
            return [0] * ((text.count(" a") + 1) // 2)
        return words(text)
    assert repeated_piece(merging, [500]) == " x"
    with pytest.raises(AnchorError):
        repeated_piece(lambda text: [0], [500])


def test_rows_sglangs_sampler_would_drop_are_refused(tmp_path: Path) -> None:
    with pytest.raises(AnchorError):
        write_sharegpt(tmp_path / "d.json", chat_rows([1]), [1], words)


def test_command_uses_the_launch_flags_the_rows_and_the_models_sampling(tmp_path: Path) -> None:
    profile = load_profile("qwen36-27b-h200-dummy")
    argv = profile_argv(profile, None)
    assert "--host" not in argv and "--port" not in argv
    assert argv[argv.index("--max-running-requests") + 1] == "40"
    assert argv[argv.index("--sampling-backend") + 1] == "pytorch"
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 1}))
    sampling = model_sampling(tmp_path)
    assert sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert model_sampling(tmp_path / "none") == {}
    cmd = command("py", argv, tmp_path / "d.json", 120, sampling, tmp_path / "r.jsonl")
    assert cmd[:3] == ["py", "-m", "sglang.bench_offline_throughput"]
    tail = cmd[3 + len(argv):]
    assert tail[tail.index("--dataset-name") + 1] == "sharegpt"
    assert tail[tail.index("--num-prompts") + 1] == "120"
    assert "--apply-chat-template" in tail
    assert json.loads(tail[tail.index("--extra-request-body") + 1]) == sampling


FAKE_CLI = '''
import argparse, json, sys
ap = argparse.ArgumentParser()
ap.add_argument("--dataset-path"); ap.add_argument("--num-prompts", type=int)
ap.add_argument("--result-filename"); ap.add_argument("--extra-request-body")
args, _ = ap.parse_known_args()
import datasets  # the real CLI imports it at module import
rows = json.load(open(args.dataset_path))[: args.num_prompts]
out = sum(len(r["conversations"][1]["value"].split()) for r in rows)
with open(args.result_filename, "a") as fh:
    fh.write(json.dumps({"successful_requests": len(rows), "total_latency": 10.0,
                         "total_output_tokens": out, "output_throughput": out / 10.0}) + "\\n")
'''


def test_run_anchor_reads_the_clis_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "bench_offline_throughput.py").write_text(FAKE_CLI)
    monkeypatch.setenv("PYTHONPATH", str(fake))
    rows = chat_rows([300, 500, 700])
    out = run_anchor(load_profile("qwen36-27b-h200-dummy"), rows, 3000, tmp_path,
                     tmp_path / "anchor.log", 60, encode=words, python=sys.executable)
    assert "error" not in out, out
    assert out["output_tok_s"] == 150.0 and out["output_tokens"] == 1500
    assert out["requests"] == 3 and out["asked_tokens"] == 1500
    assert out["command"][2] == "sglang.bench_offline_throughput"


def test_a_failing_cli_is_reported_with_its_log(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "bench_offline_throughput.py").write_text(
        "raise SystemExit('no engine here')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    out = run_anchor(load_profile("qwen36-27b-h200-dummy"), chat_rows([10]), 3000, tmp_path,
                     tmp_path / "anchor.log", 60, encode=words, python=sys.executable)
    assert out["rc"] == 1 and "no engine here" in out["error"]


def test_datasets_stub_only_where_the_package_is_missing(tmp_path: Path) -> None:
    import importlib.util
    stub = datasets_stub(tmp_path)
    if importlib.util.find_spec("datasets") is not None:
        assert stub is None
    else:
        assert stub is not None and (stub / "datasets" / "__init__.py").exists()


def test_order_ratios_and_goals() -> None:
    job = {"decode_tok_s": 740.0, "occupancy_until_all_taken": 0.995}
    before = [{"in_flight": 96, "decode_tok_s": 733.0}]
    after = [{"in_flight": 96, "decode_tok_s": 757.0}]
    [o] = gpu_check.order_ratios(job, before, after)
    assert o == {"in_flight": 96, "before": 1.01, "after": 0.978, "mean": 0.994}
    summary = {"job": job, "fixed_job": {"occupancy_until_all_taken": 0.963},
               "sglang_offline": {"output_tok_s": 755.3, "fleet_ratio": 0.98}}
    g = gpu_check.goals(summary)
    assert g["job_occupancy_until_all_taken"]["met"] is True
    assert g["fixed_job_occupancy_until_all_taken"]["met"] is False
    assert g["fleet_vs_sglang_offline"] == {"value": 0.98, "goal": 0.99, "met": False}
    assert gpu_check.ratio(None, 3.0) is None


def test_fixed_rows_all_ask_the_same_length(tmp_path: Path) -> None:
    path = gpu_check.write_prompts(tmp_path / "p.jsonl", 50, 500, 0.0, 3000, 3)
    rows = gpu_check.rows_summary(path, 0.0)
    assert rows["min_tokens"] == rows["max_tokens"] == 500 and rows["prompts"] == 50
    logn = gpu_check.rows_summary(gpu_check.write_prompts(tmp_path / "l.jsonl", 400, 500,
                                                          0.8, 3000, 1), 0.8)
    assert 430 < logn["mean_tokens"] < 570 and logn["max_tokens"] > 1000


def test_gpu_check_on_the_simulator_orders_the_plain_client_around_the_fleet(
        tmp_path: Path) -> None:
    # The whole check at a tiny size on the simulator: plain before, fleet, plain after, the
    # fixed-length job and its plain client; the anchor says it needs real SGLang.
    import os
    import subprocess
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "FLEET_SIM_SPEED": "25", "FLEET_SIM_CALIBRATION": "h200-dummy",
           "PYTHONPATH": str(root)}
    res = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--engine", "sim", "--gpus", "1",
         "--profile", "qwen36-27b", "--prompts", "30", "--batch-size", "10",
         "--mean-tokens", "100", "--max-new-tokens", "300", "--plain-before",
         "--fixed-tokens", "50", "--fixed-prompts", "20", "--anchor", "--out", str(tmp_path)],
        cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    [path] = tmp_path.glob("gpu-check-*[0-9].json")
    s = json.loads(path.read_text())
    assert [p["in_flight"] for p in s["plain_before"]] == [96] == [p["in_flight"]
                                                                 for p in s["plain"]]
    # Jobs this small end within a sample or two of the watcher: their decode rate comes from
    # the job's own first-taken time when no sample saw a request running.
    assert s["job"]["decode_tok_s"] and s["fixed_job"]["decode_tok_s"], (s["job"], s["fixed_job"])
    assert all(p["completed"] == 30 and p["fleet_ratio"]
               for p in s["plain_before"] + s["plain"]), (s["plain_before"], s["plain"])
    [order] = s["fleet_vs_plain"]
    assert order["mean"] == round((order["before"] + order["after"]) / 2, 3)
    assert s["rows"]["prompts"] == 30 and s["rows"]["sigma"] == 0.8
    fixed = s["fixed_job"]
    assert fixed["verify"]["ok"]
    assert fixed["rows"]["min_tokens"] == fixed["rows"]["max_tokens"] == 50
    assert fixed["plain"][0]["completed"] == 20
    assert "real SGLang" in s["sglang_offline"]["error"]
    assert "job_occupancy_until_all_taken" in s["goals"]
    assert (tmp_path / f"gpu-check-{s['date']}-server_info.json").exists()


def test_occupancy_from_the_schedulers_running_request_lines(tmp_path: Path) -> None:
    from bench import log_occupancy

    log = tmp_path / "anchor.log"
    log.write_text(
        "[2026-12-01 21:05:21] Prefill batch, #new-seq: 16, #new-token: 256, #running-req: 0, "
        "#queue-req: 0\n"  # the CLI's warm-up: no queue
        "[2026-12-01 21:05:22] Decode batch, #running-req: 16, gen throughput (token/s): 9\n"
        "[2026-12-01 21:05:23 TP0] Prefill batch, #new-seq: 40, #running-req: 0, "
        "#queue-req: 60\n"  # the main run: every row at once
        "[2026-12-01 21:05:25] Decode batch, #running-req: 40, #queue-req: 60\n"
        "unrelated line #running-req: 3\n"
        "[2026-12-01 21:05:28] Decode batch, #running-req: 40, #queue-req: 20\n"
        "[2026-12-01 21:05:31] Decode batch, #running-req: 10, #queue-req: 0\n")
    got = log_occupancy.anchor_run(log, 40)
    assert got["decode_lines"] == 3 and got["occupancy"] == 0.75 and got["seconds"] == 8.0
    assert got["occupancy_while_queued"] == 1.0  # the two lines with rows waiting
    lines = log_occupancy.read(log)
    t0 = lines[0].at
    assert log_occupancy.occupancy(log_occupancy.window(lines, t0 + 3, t0 + 5), 40)[
        "occupancy"] == 1.0
    assert log_occupancy.anchor_run(tmp_path / "missing.log", 40)["occupancy"] is None
    assert gpu_check.runbook_batch_size([40], 1.25) == 204
