"""Verify a job from the result store alone (never from Redis counters)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from workers.jobs import JobSpec, batch_of_result_key, decode_rows, results_prefix
from workers.store import Store


def verify_job(store: Store, spec: JobSpec) -> dict[str, Any]:
    """Count rows per index across every stored batch result and compare with the job."""
    seen: Counter[int] = Counter()
    failed = truncated = rows = 0
    out_of_range = 0
    for key in store.list(results_prefix(spec.name)):
        if batch_of_result_key(key) is None:
            continue
        for row in decode_rows(store.get(key)):
            rows += 1
            idx = int(row["index"])
            if not 0 <= idx < spec.total:
                out_of_range += 1
                continue
            seen[idx] += 1
            failed += row.get("status") == "failed"
            truncated += row.get("finish_reason") == "length"
    unique = len(seen)
    duplicates = sum(n - 1 for n in seen.values())
    missing = spec.total - unique
    return {
        "job": spec.name, "expected": spec.total, "rows": rows, "unique": unique,
        "duplicates": duplicates, "missing": missing, "failed": failed,
        "truncated": truncated, "out_of_range": out_of_range,
        "ok": duplicates == 0 and missing == 0 and out_of_range == 0,
    }
