"""The GPU check's rows: the workload's shape (log-normal lengths) as OpenAI-batch lines."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from bench.plain_client import read_prompts

# The workload's output lengths (docs/workload.md): log-normal, mean 2,490, capped at
# --max-new-tokens 7000. A run of minutes on one GPU scales the mean down, keeps the shape.
WORKLOAD_SIGMA = 0.8


def write_prompts(path: Path, n: int, mean_tokens: float, sigma: float, cap: int,
                  seed: int) -> Path:
    """``n`` OpenAI-batch chat rows, each with a seeded ``max_tokens`` from a log-normal."""
    rng = random.Random(seed)
    mu = math.log(mean_tokens) - sigma * sigma / 2
    with path.open("w") as fh:
        for i in range(n):
            tokens = max(1, min(cap, round(rng.lognormvariate(mu, sigma))))
            # OpenAI-batch lines: the form whose per-row max_tokens enqueue honours.
            row = {"custom_id": f"gc-{i}", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"max_tokens": tokens, "messages": [
                       {"role": "user", "content": f"Explain idea {i} step by step."}]}}
            fh.write(json.dumps(row) + "\n")
    return path


def rows_summary(path: Path, sigma: float) -> dict[str, Any]:
    """What the rows ask for: count, shape, mean / min / max of their ``max_tokens``."""
    lengths = [int(r["body"]["max_tokens"]) for r in read_prompts(path)]
    return {"prompts": len(lengths), "sigma": sigma,
            "mean_tokens": round(sum(lengths) / max(len(lengths), 1), 1),
            "min_tokens": min(lengths, default=0), "max_tokens": max(lengths, default=0),
            "sampling": "the model's generation_config (sampled, not greedy)"}
