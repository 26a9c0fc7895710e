"""The aggregated data set of a job: store keys, the Parquet schema, row counts, the manifest.

Layout under the job's root (``jobs/<job>/``)::

    data/part-00000.parquet   shards: one row per prompt, sorted by index, zstd
    manifest.json             job parameters, shards (rows, index range, bytes, sha256), counts
    _SUCCESS                  sha256 of manifest.json; present only when verify passed

Every field of the manifest is derived from the store (the job record and the batch results),
except ``finished_at``, which is kept from the previous manifest when the shards are the same.
Running the sink twice therefore writes byte-identical shards and manifest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import orjson
import pyarrow as pa

from workers.jobs import JobSpec
from workers.store import ObjectMissing, Store

MANIFEST_FORMAT = 1

_MESSAGE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])

# One row per prompt. ``messages`` keeps role and content (non-string content as JSON text);
# the per-batch results under results/ keep every message exactly as it was sent.
SCHEMA = pa.schema([
    pa.field("index", pa.int64(), nullable=False),
    pa.field("id", pa.string(), nullable=False),
    pa.field("job", pa.string()),
    pa.field("batch", pa.int32()),
    pa.field("prompt", pa.string()),
    pa.field("messages", pa.list_(_MESSAGE)),
    pa.field("completion", pa.string()),
    pa.field("reasoning", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("status", pa.string()),
    pa.field("error", pa.string()),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("latency_s", pa.float64()),
    pa.field("profile", pa.string()),
    pa.field("gpu", pa.int16()),
    pa.field("node", pa.string()),
    pa.field("reused_from", pa.string()),
])


def data_prefix(job: str) -> str:
    """Store prefix of a job's data-set shards."""
    return f"jobs/{job}/data/"


def shard_key(job: str, n: int) -> str:
    """Store key of shard ``n``."""
    return f"{data_prefix(job)}part-{n:05d}.parquet"


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
    return rec


def row_bucket(row: dict[str, Any]) -> str:
    """Count bucket of a row: ok, truncated, failed or quarantined (disjoint)."""
    if row.get("status") == "ok":
        return "truncated" if row.get("finish_reason") == "length" else "ok"
    unusable = row.get("prompt") is None and row.get("messages") is None
    if unusable or str(row.get("error") or "").startswith("poison prompt"):
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
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def _model_of(profile: str) -> str | None:
    from config.launch_profile import ProfileError, load_profile

    try:
        model = load_profile(profile).flag("model-path")
    except (ProfileError, OSError, ValueError):
        return None
    return None if model is None else str(model)


def shards_digest(shards: list[ShardInfo]) -> str:
    """sha256 over the shards' keys and hashes: equal digests mean the same data set."""
    text = "\n".join(f"{s.key} {s.sha256}" for s in shards)
    return hashlib.sha256(text.encode()).hexdigest()


def build_manifest(spec: JobSpec, shards: list[ShardInfo], tally: Tally,
                   verify: dict[str, Any], finished_at: float) -> dict[str, Any]:
    """The manifest object (see the module docstring)."""
    profiles = {p: {"rows": n, "model": _model_of(p)} for p, n in sorted(tally.profiles.items())}
    return {
        "format": MANIFEST_FORMAT,
        "job": spec.name,
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
        },
        "schema": [{"name": f.name, "type": str(f.type), "nullable": f.nullable}
                   for f in SCHEMA],
        "shards": [vars(s) for s in shards],
        "digest": shards_digest(shards),
        "totals": {
            "rows": sum(s.rows for s in shards), "shards": len(shards),
            "bytes": sum(s.bytes for s in shards),
            "prompt_tokens": tally.prompt_tokens, "completion_tokens": tally.completion_tokens,
        },
        "counts": tally.counts,
        "verify": verify,
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
