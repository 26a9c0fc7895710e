"""The aggregated data set of a job: store keys, the Parquet schema, row counts, the manifest.

Layout under the job's root (``jobs/<job>/``)::

    data/<version>/part-00000.parquet   shards of one sink run: one row per prompt, by index
    manifest.json     the commit point: names the version, its shards (rows, index range,
                      bytes, sha256), job parameters and counts
    _SUCCESS          sha256 of manifest.json; present only when that data set is complete

Each sink run writes its shards under a new ``data/<version>/`` prefix; the manifest, written
last in one atomic put, names that version, so a reader that goes through the manifest
(:func:`committed_prefix`, ``python -m producer dataset-path``) sees one complete version,
never shards of two runs. Earlier versions are deleted only after the new manifest is in place.

Every field of the manifest is derived from the store (the job record and the batch results),
except ``version`` and ``finished_at``; a re-run that produces the same shards keeps the
committed version (and its manifest, byte for byte) and drops what it wrote.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
import pyarrow as pa

from config.launch_profile import LaunchProfile
from workers.dataset.jobs import JobSpec
from workers.dataset.store import ObjectMissing, Store
from workers.errors import QUARANTINE_PREFIXES, JobError

MANIFEST_FORMAT = 2

_MESSAGE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])

# One row per (prompt, sample). ``messages`` keeps role and content (non-string content as
# JSON text); the per-batch results under results/ keep every message exactly as it was sent.
# ``tool_calls`` is the chat message's tool calls as JSON text (null when there are none).
# Kept input columns (enqueue --keep-columns) follow these: :func:`job_schema`.
SCHEMA = pa.schema([
    pa.field("index", pa.int64(), nullable=False),
    pa.field("sample", pa.int32()),
    pa.field("id", pa.string(), nullable=False),
    pa.field("job", pa.string()),
    pa.field("batch", pa.int32()),
    pa.field("prompt", pa.string()),
    pa.field("messages", pa.list_(_MESSAGE)),
    pa.field("completion", pa.string()),
    pa.field("reasoning", pa.string()),
    pa.field("tool_calls", pa.string()),
    # The engine's sampled token ids: /generate's ``output_ids``; the chat choice's
    # ``token_ids`` / ``response_token_ids`` (SGLang 0.5.17 / 0.5.18 on, return_token_ids);
    # null where the engine returned none (chat on 0.5.10.post1-0.5.16). docs/output.md.
    pa.field("output_ids", pa.list_(pa.int32())),
    pa.field("finish_reason", pa.string()),
    pa.field("status", pa.string()),
    pa.field("error", pa.string()),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("latency_s", pa.float64()),
    pa.field("logprobs", pa.string()),
    pa.field("profile", pa.string()),
    pa.field("gpu", pa.int16()),
    pa.field("node", pa.string()),
    pa.field("reused_from", pa.string()),
    pa.field("launch_digest", pa.string()),
    pa.field("finished_at", pa.float64()),
])


def job_schema(spec: JobSpec) -> pa.Schema:
    """The data set's schema for ``spec``: SCHEMA, then its kept input columns."""
    from workers.dataset.kept import decode_schema

    kept = decode_schema(spec.keep_schema)
    return SCHEMA if kept is None else pa.schema(list(SCHEMA) + list(kept))


def launch_digest(profile: LaunchProfile) -> str:
    """Digest of an engine's effective launch: its flags and environment, not its name, so an
    edited profile under the same name, or another profile, gives another digest."""
    doc = {"flags": profile.flags, "env": profile.env}
    return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def data_prefix(job: str) -> str:
    """Store prefix under which every version of a job's data set lives."""
    return f"jobs/{job}/data/"


def version_prefix(job: str, version: str) -> str:
    """Store prefix of one version of the data set (one sink run)."""
    return f"{data_prefix(job)}{version}/"


def shard_key(job: str, version: str, n: int) -> str:
    """Store key of shard ``n`` of ``version``."""
    return f"{version_prefix(job, version)}{shard_name(n)}"


def shard_name(n: int) -> str:
    """File name of shard ``n`` (the same in every version)."""
    return f"part-{n:05d}.parquet"


def manifest_key(job: str) -> str:
    """Store key of the manifest."""
    return f"jobs/{job}/manifest.json"


def success_key(job: str) -> str:
    """Store key of the ``_SUCCESS`` marker."""
    return f"jobs/{job}/_SUCCESS"


def _message(m: Any) -> dict[str, str | None]:
    if not isinstance(m, dict):
        return {"role": None, "content": orjson.dumps(m).decode()}
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        content = orjson.dumps(content).decode()
    role = m.get("role")
    return {"role": None if role is None else str(role), "content": content}


def to_record(row: dict[str, Any]) -> dict[str, Any]:
    """A stored result row in the shape of SCHEMA."""
    rec = {name: row.get(name) for name in SCHEMA.names}
    if rec["messages"] is not None:
        rec["messages"] = [_message(m) for m in rec["messages"]]
    rec["id"] = str(rec["id"]) if rec["id"] is not None else str(rec["index"])
    rec["sample"] = rec["sample"] or 0
    return rec


def row_bucket(row: dict[str, Any]) -> str:
    """Count bucket of a row: ok, truncated, failed or quarantined (disjoint). Quarantined:
    no usable prompt, or an error that says why the prompt itself cannot be answered
    (``workers.errors.QUARANTINE_PREFIXES``: the engine's 400, too long for the context, a
    poison prompt)."""
    if row.get("status") == "ok":
        return "truncated" if row.get("finish_reason") == "length" else "ok"
    unusable = row.get("prompt") is None and row.get("messages") is None
    if unusable or str(row.get("error") or "").startswith(QUARANTINE_PREFIXES):
        return "quarantined"
    return "failed"


@dataclass
class ShardInfo:
    """One written shard as the manifest lists it."""

    key: str
    rows: int
    first_index: int
    last_index: int
    first_batch: int
    last_batch: int
    bytes: int
    sha256: str


@dataclass
class Tally:
    """Counts over every row that went into the data set."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("ok", "truncated", "failed", "quarantined", "reused"), 0))
    prompt_tokens: int = 0
    completion_tokens: int = 0
    profiles: dict[str, int] = field(default_factory=dict)

    def add(self, row: dict[str, Any]) -> None:
        """Count one row."""
        self.counts[row_bucket(row)] += 1
        self.counts["reused"] += row.get("reused_from") is not None
        self.prompt_tokens += int(row.get("prompt_tokens") or 0)
        self.completion_tokens += int(row.get("completion_tokens") or 0)
        if row.get("profile"):
            self.profiles[row["profile"]] = self.profiles.get(row["profile"], 0) + 1


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat().replace("+00:00", "Z")


def _model_of(profile: str) -> str | None:
    from config.launch_profile import ProfileError, load_profile

    try:
        model = load_profile(profile).flag("model-path")
    except (ProfileError, OSError, ValueError):
        return None
    return None if model is None else str(model)


def shards_digest(shards: list[ShardInfo]) -> str:
    """sha256 over the shards' file names and hashes (not their version): equal digests mean
    the same data set."""
    text = "\n".join(f"{s.key.rsplit('/', 1)[-1]} {s.sha256}" for s in shards)
    return hashlib.sha256(text.encode()).hexdigest()


def build_manifest(spec: JobSpec, version: str, shards: list[ShardInfo], tally: Tally,
                   verify: dict[str, Any], finished_at: float,
                   location: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest object (see the module docstring); ``complete`` is verify's ``ok`` over
    the rows written into ``shards``; ``store`` says where the data lives (on this node or
    off it, workers/dataset/location.py)."""
    profiles = {p: {"rows": n, "model": _model_of(p)} for p, n in sorted(tally.profiles.items())}
    return {
        "format": MANIFEST_FORMAT,
        "job": spec.name,
        "version": version,
        "data_prefix": version_prefix(spec.name, version),
        "complete": bool(verify.get("ok")),
        "created_at": _iso(spec.created_at),
        "finished_at": _iso(finished_at),
        "finished_at_unix": finished_at,
        "params": {
            "profiles": profiles,
            "sampling": spec.sampling.model_dump(),
            "input_path": spec.input_path,
            "input_fingerprint": spec.input_fingerprint,
            "total": spec.total, "batch_size": spec.batch_size, "n_batches": spec.n_batches,
            "samples": spec.expected_samples, "keep_columns": spec.keep_columns,
        },
        "schema": [{"name": f.name, "type": str(f.type), "nullable": f.nullable}
                   for f in job_schema(spec)],
        "shards": [vars(s) for s in shards],
        "digest": shards_digest(shards),
        "totals": {
            "rows": sum(s.rows for s in shards), "shards": len(shards),
            "bytes": sum(s.bytes for s in shards),
            "prompt_tokens": tally.prompt_tokens, "completion_tokens": tally.completion_tokens,
        },
        "counts": tally.counts,
        "verify": {k: v for k, v in verify.items() if k != "quality"},
        # Figures of the rows written, the gates and which failed (workers/dataset/quality.py).
        "quality": verify.get("quality"),
        "store": location,
    }


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """Canonical bytes of a manifest (sorted keys, so equal manifests are equal bytes)."""
    return orjson.dumps(manifest, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


def load_manifest(store: Store, job: str) -> dict[str, Any] | None:
    """The job's manifest, or None when the sink has not written one."""
    try:
        return dict(orjson.loads(store.get(manifest_key(job))))
    except ObjectMissing:
        return None


def success_body(manifest_bytes: bytes) -> bytes:
    """What ``_SUCCESS`` holds: the sha256 of the manifest it vouches for."""
    return hashlib.sha256(manifest_bytes).hexdigest().encode() + b"\n"


def committed_prefix(store: Store, job: str, allow_incomplete: bool = False) -> str:
    """Store prefix of the committed version of the data set.

    JobError when there is none yet, when the manifest is of the old flat layout, or (unless
    ``allow_incomplete``) when the committed data set is not complete."""
    try:
        raw = store.get(manifest_key(job))
    except ObjectMissing as exc:
        raise JobError(f"job {job!r} has no data set yet; run: fleet sink --job {job} "
                       "--local (a GPU worker's sink queue builds it when the job ends)") from exc
    manifest = orjson.loads(raw)
    if "data_prefix" not in manifest:
        raise JobError(f"the data set of job {job!r} has the old layout; run the sink again")
    if not (allow_incomplete or manifest["complete"]):
        raise JobError(f"the data set of job {job!r} is not complete (see manifest.json "
                       "'verify'); pass --allow-incomplete to read it anyway")
    return str(manifest["data_prefix"])


def location(store_url: str, key: str) -> str:
    """Where a reader finds ``key``: a local path for a ``file://`` store, else the URL."""
    if store_url.startswith("file://"):
        from urllib.parse import unquote, urlparse

        parsed = urlparse(store_url)
        return unquote(parsed.netloc + parsed.path).rstrip("/") + "/" + key
    return store_url.rstrip("/") + "/" + key
