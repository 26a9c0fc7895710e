"""Jobs in the store: the job record, the staged batch inputs and the per-batch results.

The store is the source of truth (design-notes §4): it holds what a job is, what each batch
must generate and what each batch produced. Redis holds only queues, leases and live counters,
so ``enqueue`` can always rebuild the queue from the store.

Layout under the store root::

    jobs/<job>/job.json                   the JobSpec
    jobs/<job>/inputs/b000012.jsonl.gz    staged prompts of batch 12 (claim check)
    jobs/<job>/results/b000012.jsonl      every row of batch 12, written once it is complete
"""

from __future__ import annotations

import gzip
import re
import time
from typing import Any

import orjson
from pydantic import BaseModel, Field

from workers.errors import JobError
from workers.store import ObjectMissing, Store

# Matched in full: re.match(...$) would also take a trailing newline ("job\n").
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class SamplingSpec(BaseModel):
    """Job-wide sampling parameters."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None


class JobSpec(BaseModel):
    """What a job is: recorded once by ``enqueue`` and checked on every re-run."""

    name: str
    total: int
    batch_size: int
    n_batches: int
    input_path: str
    input_fingerprint: str
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    bad_rows: int = 0
    created_at: float = Field(default_factory=time.time)

    def batch_range(self, batch: int) -> range:
        """Row indices that batch ``batch`` covers."""
        start = batch * self.batch_size
        return range(start, min(start + self.batch_size, self.total))


class PromptRow(BaseModel):
    """One staged input row: a prompt or chat messages, or the reason it could not be used."""

    index: int
    id: str
    prompt: str | None = None
    messages: list[Any] | None = None
    # Per-row request overrides (OpenAI-batch bodies carry max_tokens, temperature, ...).
    params: dict[str, Any] = Field(default_factory=dict)
    # Set for rows quarantined at read time ("line 12: no prompt or messages").
    error: str | None = None


def check_job_name(name: str) -> str:
    """Return ``name`` if it is a valid job name, else raise JobError."""
    if not isinstance(name, str) or JOB_NAME.fullmatch(name) is None:
        raise JobError(f"invalid job name {name!r}: use letters, digits, '.', '_' or '-'")
    return name


def job_key(job: str) -> str:
    """Store key of the job record."""
    return f"jobs/{job}/job.json"


def input_key(job: str, batch: int) -> str:
    """Store key of a batch's staged prompts."""
    return f"jobs/{job}/inputs/b{batch:06d}.jsonl.gz"


def result_key(job: str, batch: int) -> str:
    """Store key of a batch's results (deterministic: a redelivery overwrites it)."""
    return f"jobs/{job}/results/b{batch:06d}.jsonl"


def results_prefix(job: str) -> str:
    """Store prefix holding every batch result of a job."""
    return f"jobs/{job}/results/"


def batch_of_result_key(key: str) -> int | None:
    """Batch number of a result key, or None for other objects."""
    m = re.search(r"/results/b(\d{6})\.jsonl$", key)
    return int(m.group(1)) if m else None


def save_spec(store: Store, spec: JobSpec) -> None:
    """Write the job record."""
    store.put(job_key(spec.name), spec.model_dump_json(indent=2).encode())


def load_spec(store: Store, job: str) -> JobSpec:
    """Read the job record; JobError if the name is invalid or the job does not exist."""
    check_job_name(job)
    try:
        return JobSpec.model_validate_json(store.get(job_key(job)))
    except ObjectMissing as exc:
        raise JobError(f"no job {job!r} in {store.url}") from exc


def encode_rows(rows: list[dict[str, Any]], compress: bool) -> bytes:
    """JSONL bytes (gzip-compressed when asked)."""
    data = b"".join([orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in rows])
    return compress_rows(data) if compress else data


def compress_rows(data: bytes) -> bytes:
    """JSONL bytes compressed as staged inputs are stored (gzip, level 1)."""
    return gzip.compress(data, compresslevel=1)


def decode_rows(data: bytes) -> list[dict[str, Any]]:
    """Rows of a JSONL object (gzip detected by its magic bytes)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def load_batch_input(store: Store, job: str, batch: int) -> list[PromptRow]:
    """The staged prompts of one batch."""
    try:
        raw = store.get(input_key(job, batch))
    except ObjectMissing as exc:
        raise JobError(f"staged input of {job} batch {batch} is missing") from exc
    return [PromptRow.model_validate(r) for r in decode_rows(raw)]
