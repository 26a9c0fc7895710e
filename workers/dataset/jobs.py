"""Jobs in the store: the job record, the staged batch inputs and the per-batch results.

The store is the source of truth: it holds what a job is, what each batch
must generate and what each batch produced. Redis holds only queues, leases and live counters,
so ``enqueue`` can always rebuild the queue from the store.

Layout under the store root::

    jobs/<job>/job.json                   the JobSpec
    jobs/<job>/inputs/b000012.jsonl.gz    staged prompts of batch 12 (claim check)
    jobs/<job>/results/b000012.jsonl      every row of batch 12, written once it is complete
    jobs/<job>/progress/b000012/*.jsonl   answered rows of batch 12 while it runs (chunks)
"""

from __future__ import annotations

import gzip
import hashlib
import re
import time
import zlib
from typing import Any, Literal

import orjson
from pydantic import BaseModel, Field

from workers.dataset.store import ObjectMissing, Store
from workers.errors import JobError

# Matched in full: re.match(...$) would also take a trailing newline ("job\n").
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class SamplingSpec(BaseModel):
    """Job-wide sampling parameters and request options (rows' own override them; see
    workers/engine/sampling.py for the precedence)."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # --sampling KEY=VALUE, as SGLang SamplingParams keywords (workers/engine/sampling.py).
    params: dict[str, Any] = Field(default_factory=dict)
    # --chat: plain prompts go through the chat template as one user message.
    chat: bool = False
    # --system-prompt: prepended to chat requests that have no system message of their own.
    system_prompt: str | None = None
    # --chat-template-kwargs, e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    # --drop-unsupported-sampling: row keys the engine would refuse were left out at enqueue.
    drop_unsupported: bool = False
    # --samples N (or --sampling n=N): samples per prompt; a row's own OpenAI ``n`` wins
    # (workers/dataset/samples.py).
    samples: int = 1


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
    # Row parameter keys never sent to the engine (metadata such as "user", or keys
    # --drop-unsupported-sampling dropped), with how many rows carried each.
    dropped_keys: dict[str, int] = Field(default_factory=dict)
    created_at: float = Field(default_factory=time.time)
    # sha256 of each staged batch's uncompressed JSONL (empty for jobs staged before it).
    input_sha256: list[str] = Field(default_factory=list)
    # Every (prompt, sample) the job generates: the sum of each row's samples (0: one per
    # prompt, jobs from before samples).
    total_samples: int = 0
    # --keep-columns: input columns carried into the data set, name -> Arrow type as text
    # ("json" for JSONL values that do not agree on one type: kept as JSON text).
    keep_columns: dict[str, str] = Field(default_factory=dict)
    # Their Arrow schema, base64 of its IPC serialization (workers/dataset/kept.py).
    keep_schema: str | None = None
    # --keep-columns as given ("a,b" or "*"): a re-run of enqueue without it reads the same.
    keep_arg: str | None = None
    # --quality KEY=VALUE: the job's quality thresholds (workers/dataset/quality_gates.py;
    # the defaults apply to every key not given).
    quality: dict[str, float] = Field(default_factory=dict)
    # --on-quality-warning: "warn" (the live warning is shown and logged) or "pause" (the job
    # is also paused when its live tally first fails a gate; workers/delivery/quality_live.py).
    on_quality_warning: Literal["warn", "pause"] = "warn"

    @property
    def expected_samples(self) -> int:
        """Result rows the job must end with: one per (prompt, sample)."""
        return self.total_samples or self.total

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
    # --keep-columns: the row's kept input values, stored once per prompt (not per sample).
    keep: dict[str, Any] | None = None


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


def progress_prefix(job: str, batch: int) -> str:
    """Store prefix of a running batch's answered rows, spilled in chunks
    (workers/delivery/progress.py)."""
    return f"jobs/{job}/progress/b{batch:06d}/"


def progress_chunk_key(job: str, batch: int, chunk: str) -> str:
    """Store key of one chunk of a batch's answered rows."""
    return f"{progress_prefix(job, batch)}{chunk}.jsonl"


def result_key(job: str, batch: int) -> str:
    """Store key of a batch's results (deterministic: a redelivery overwrites it)."""
    return f"jobs/{job}/results/b{batch:06d}.jsonl"


def results_prefix(job: str) -> str:
    """Store prefix holding every batch result of a job."""
    return f"jobs/{job}/results/"


def batch_of_input_key(key: str) -> int:
    """Batch number of a staged-input key."""
    m = re.search(r"/inputs/b(\d{6})\.jsonl\.gz$", key)
    if not m:
        raise ValueError(f"not a staged-input key: {key}")
    return int(m.group(1))


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


def uncompressed(data: bytes) -> bytes:
    """JSONL bytes of a stored object (gzip detected by its magic bytes); JobError if the
    gzip stream is damaged."""
    if data[:2] != b"\x1f\x8b":
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise JobError(f"damaged gzip data: {exc}") from exc


def staged_sha256(jsonl: bytes) -> str:
    """sha256 of a staged batch, over its uncompressed JSONL (gzip headers carry a time)."""
    return hashlib.sha256(jsonl).hexdigest()


def decode_rows(data: bytes) -> list[dict[str, Any]]:
    """Rows of a JSONL object (gzip detected by its magic bytes)."""
    data = uncompressed(data)
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def load_batch_input(store: Store, job: str, batch: int) -> list[PromptRow]:
    """The staged prompts of one batch."""
    try:
        raw = store.get(input_key(job, batch))
    except ObjectMissing as exc:
        raise JobError(f"staged input of {job} batch {batch} is missing") from exc
    return [PromptRow.model_validate(r) for r in decode_rows(raw)]


def load_checked_input(store: Store, spec: JobSpec, batch: int) -> list[PromptRow]:
    """The staged prompts of one batch, checked against the job record: the sha256 ``enqueue``
    recorded, and exactly the indices of the batch's range. JobError (re-run ``enqueue`` to
    re-stage it) when the object is missing, damaged or not this batch's."""
    where = f"staged input of {spec.name} batch {batch}"
    try:
        data = uncompressed(store.get(input_key(spec.name, batch)))
    except ObjectMissing as exc:
        raise JobError(f"{where} is missing; re-run enqueue to stage it") from exc
    except JobError as exc:
        raise JobError(f"{where} is corrupt ({exc}); re-run enqueue to re-stage it") from exc
    if batch < len(spec.input_sha256) and staged_sha256(data) != spec.input_sha256[batch]:
        raise JobError(f"{where} is corrupt (sha256 differs from the job record); re-run "
                       "enqueue to re-stage it")
    try:
        rows = [PromptRow.model_validate_json(line) for line in data.splitlines() if line.strip()]
    except ValueError as exc:
        raise JobError(f"{where} is corrupt ({str(exc).splitlines()[0]})") from exc
    if [r.index for r in rows] != list(spec.batch_range(batch)):
        raise JobError(f"{where} does not hold the batch's indices "
                       f"{spec.batch_range(batch).start}..{spec.batch_range(batch).stop - 1}")
    return rows
