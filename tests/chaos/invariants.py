"""What must hold once a schedule settled and the documented remedy ran (issue 12).

Each check returns a list of violations (one readable line each; empty means it holds). The
store is the truth: rows are read from the result objects, never from Redis; Redis and the
commands' output are compared against it.
"""

from __future__ import annotations

import base64
import hashlib
import io
import time
from collections import Counter
from typing import Any

import orjson
import pyarrow.parquet as pq
import redis

from tests.chaos.cluster import Cluster
from tests.conftest import run_producer
from workers.dataset.jobs import batch_of_result_key, decode_rows, results_prefix
from workers.dataset.manifest import manifest_key, row_bucket
from workers.dataset.store import ObjectMissing, Store

COMPARED = ("index", "sample", "batch", "status", "finish_reason", "completion", "node")


def stored_rows(store: Store, job: str) -> dict[int, list[dict[str, Any]]]:
    """Every stored result row of ``job``, by batch."""
    out = {}
    for key in store.list(results_prefix(job)):
        if (b := batch_of_result_key(key)) is not None:
            try:
                out[b] = decode_rows(store.get(key))
            except ObjectMissing:  # deleted between list and get
                continue
    return out


def _command_json(c: Cluster, *args: str) -> tuple[int, Any]:
    res = run_producer(c.env, *args, "--json", timeout_s=120)
    try:
        return res.returncode, orjson.loads(res.stdout)
    except orjson.JSONDecodeError:
        return res.returncode, (res.stderr or res.stdout).strip()[-300:]


def check_verify(c: Cluster, job: str) -> tuple[list[str], dict[str, Any]]:
    """``verify --job --json``: every prompt exactly once."""
    code, report = _command_json(c, "verify", "--job", job)
    if not isinstance(report, dict):
        return [f"{job}: verify failed to run (rc={code}): {report}"], {}
    # Exit 5 is a quality gate (every row there, some answers poor): not this invariant's.
    if report.get("ok") and code in (0, 5):
        return [], report
    said = (f"{job}: verify not ok: missing={report.get('missing')} duplicates="
            f"{report.get('duplicates')} rows={report.get('rows')}/{report.get('expected')}")
    return [said], report


def check_counters(c: Cluster, job: str, rows: dict[int, list[dict[str, Any]]],
                   n_batches: int) -> list[str]:
    """``status --json`` counters equal what the store holds."""
    code, st = _command_json(c, "status", "--job", job)
    if not isinstance(st, dict):
        return [f"{job}: status failed to run (rc={code}): {st}"]
    flat = [x for batch in rows.values() for x in batch]
    # A row that did not finish counts as the manifest buckets it: an engine's refusal of the
    # prompt (HTTP 400) is quarantined, another failure failed (manifest.row_bucket).
    buckets = [row_bucket(x) for x in flat if x.get("status") != "ok"]
    stored = {"completed": sum(x.get("status") == "ok" for x in flat),
              "failed": buckets.count("failed"), "quarantined": buckets.count("quarantined"),
              "done_batches": len(rows)}
    out = [f"{job}: status {k}={st.get(k)} but the store holds {v}"
           for k, v in stored.items() if st.get(k) != v]
    if len(rows) == n_batches and not st.get("done"):
        out.append(f"{job}: every batch is stored but status says done=false")
    return out


def _message_batch(payload: Any) -> tuple[str, int] | None:
    """(job, batch) of a kombu message carrying fleet.run_batch (Celery protocol 2)."""
    try:
        msg = orjson.loads(payload) if isinstance(payload, bytes | str) else payload
        if msg.get("headers", {}).get("task") != "fleet.run_batch":
            return None
        args = orjson.loads(base64.b64decode(msg["body"]))[0]
        return str(args[0]), int(args[1])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None


def messages(client: redis.Redis) -> Counter[tuple[str, int]]:
    """Batch messages in the queue lists and in kombu's ``unacked`` hash (delivered, unacked)."""
    found: Counter[tuple[str, int]] = Counter()
    for name in client.scan_iter(match="gpu*", _type="LIST"):
        for raw in client.lrange(name, 0, -1):
            if (jb := _message_batch(raw)) is not None:
                found[jb] += 1
    for raw in client.hvals("unacked"):
        try:
            payload = orjson.loads(raw)[0]
        except (orjson.JSONDecodeError, IndexError, TypeError):
            continue
        if (jb := _message_batch(payload)) is not None:
            found[jb] += 1
    return found


def _owned(client: redis.Redis, job: str, batch: int) -> bool:
    """Whether a run holds a fencing token for ``batch`` (``owner:{b}``, which expires unless
    its run renews it). A ``running`` entry is no proof: it outlives its run, and a worker
    restarted under the same node name looks alive. A run of today's code is seen through its
    delivery instead, which stays in kombu's ``unacked`` hash until acked (acks late)."""
    return bool(client.exists(f"fleet:job:{job}:owner:{batch}"))


def stranded(c: Cluster, job: str, n_batches: int) -> list[int]:
    """Batches the store does not hold that have no message anywhere (queue lists, kombu's
    ``unacked`` hash) and no live holder: nothing will ever run them unless someone resends
    them. Derived from the store, not from Redis's own idea of what is pending."""
    have = set(stored_rows(c.store(), job))
    client = c.client()
    try:
        held = messages(client)
        return [b for b in range(n_batches)
                if b not in have and not held[(job, b)] and not _owned(client, job, b)]
    finally:
        client.close()


def _shard_rows(store: Store, shard: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    data = store.get(shard["key"])
    problems = []
    if hashlib.sha256(data).hexdigest() != shard["sha256"]:
        problems.append(f"shard {shard['key']} does not match its sha256 in the manifest")
    table = pq.read_table(io.BytesIO(data), columns=list(COMPARED))
    return problems, table.to_pylist()


def check_manifest(c: Cluster, job: str, rows: dict[int, list[dict[str, Any]]],
                   wait_s: float) -> list[str]:
    """The sink's manifest (written when the job's last batch was done) is complete and its
    shards hold exactly the rows the store holds now."""
    store = c.store()
    deadline = time.monotonic() + wait_s
    manifest = None
    while time.monotonic() < deadline:
        try:
            manifest = orjson.loads(store.get(manifest_key(job)))
        except ObjectMissing:
            manifest = None
        if manifest is not None and manifest.get("complete"):
            break
        time.sleep(1.0)
    if manifest is None:
        return [f"{job}: no manifest {wait_s:.0f} s after the job was done"]
    out = [] if manifest.get("complete") else [f"{job}: the manifest says complete=false"]
    # One row per (prompt, sample): rows from before samples are sample 0, as in the data set.
    want = {(x["index"], x.get("sample") or 0): tuple(x.get(k) or 0 if k == "sample"
                                                      else x.get(k) for k in COMPARED)
            for b in rows.values() for x in b}
    got: dict[tuple[int, int], tuple[Any, ...]] = {}
    for shard in manifest.get("shards", []):
        try:
            problems, shard_rows = _shard_rows(store, shard)
        except ObjectMissing:
            out.append(f"{job}: shard {shard['key']} in the manifest is missing from the store")
            continue
        out += [f"{job}: {p}" for p in problems]
        got.update({(x["index"], x["sample"]): tuple(x.get(k) for k in COMPARED)
                    for x in shard_rows})
    differ = sorted(i for i in want.keys() | got.keys() if want.get(i) != got.get(i))
    if differ:
        out.append(f"{job}: the manifest's data set differs from the stored results at "
                   f"{len(differ)} rows (first: {differ[:5]})")
    return out


def check_export(c: Cluster, job: str, rows: dict[int, list[dict[str, Any]]],
                 kept: str | None = None) -> list[str]:
    """``export --format hf`` of the committed data set accounts for every stored row (each
    answered one in the folder, from the request rebuilt from its staged input; the others in
    the errors file), with the kept column ``kept`` on every row."""
    import datasets

    out = c.root / "exports" / job
    res = run_producer(c.env, "export", "--job", job, "--format", "hf", "--out", str(out),
                       timeout_s=180)
    if res.returncode != 0:
        return [f"{job}: export --format hf rc={res.returncode}: {res.stderr.strip()[-300:]}"]
    flat = [x for batch in rows.values() for x in batch]
    answered = sum(x.get("status") == "ok" for x in flat)
    table = datasets.load_dataset(str(out), split="train",
                                  cache_dir=str(c.root / "exports" / "cache")).to_list()
    errors = (out.parent / f"{job}.errors.jsonl").read_bytes().splitlines()
    problems = []
    if (len(table), len(errors)) != (answered, len(flat) - answered):
        problems.append(f"{job}: the hf export holds {len(table)} rows and {len(errors)} "
                        f"errors; the store {answered} answered of {len(flat)}")
    if kept and any(r.get(kept) is None for r in table):
        problems.append(f"{job}: hf export rows without their kept {kept!r}")
    return problems


def check_orphans(c: Cluster, wait_s: float) -> list[str]:
    """After every worker stopped: no engine (or guard) of this cluster is left running."""
    deadline = time.monotonic() + wait_s
    while (left := c.engine_leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [f"engine process {p.pid} outlived its worker: {' '.join(p.argv[:3])} ... "
            f"{' '.join(p.argv[-4:])}" for p in left]
