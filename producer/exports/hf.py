"""``fleet export --format hf --out DIR``: a folder ``datasets.load_dataset(DIR)`` opens.

``DIR/data/train-NNNNN-of-MMMMM.parquet`` shards (one ``train`` split: every answered row)
and ``DIR/README.md``, a dataset card whose YAML metadata gives the ``license``
(``--license``, default ``other``), the ``configs`` (the split's files) and the
``dataset_info`` (features and splits, from ``datasets``' own ``DatasetInfo._to_yaml_dict``),
and whose text names the job's model, its sampling, the verdict ``fleet verify`` gives and its
quality figures. ``conversations`` holds the messages the engine was sent (every field, tool
calls in OpenAI's shape), then the generated turn; the kept input columns follow the export's
own. Failed and quarantined rows go to ``DIR.errors.jsonl`` beside the folder.
Pushing it to the Hub is the user's one-liner (docs/output.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from producer.exports.conversation import content_id, conversation, row_tools
from producer.exports.sent import Sent
from producer.exports.source import (
    DataSet,
    ExportRun,
    Tally,
    atomic_dir,
    error_file,
    errors_path,
    kept_columns,
    with_kept,
)
from workers.dataset.quality_gates import gate_line
from workers.errors import JobError

_CALL = pa.struct([pa.field("id", pa.string()), pa.field("type", pa.string()),
                   pa.field("function", pa.struct([pa.field("name", pa.string()),
                                                   pa.field("arguments", pa.string())]))])
_TURN = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string()),
                   pa.field("reasoning_content", pa.string()),
                   pa.field("tool_calls", pa.list_(_CALL)),
                   pa.field("tool_call_id", pa.string()), pa.field("name", pa.string())])
HF_FIELDS = [
    pa.field("id", pa.string()), pa.field("input_id", pa.string()),
    pa.field("sample", pa.int32()), pa.field("conversations", pa.list_(_TURN)),
    pa.field("tools", pa.string()), pa.field("completion", pa.string()),
    pa.field("reasoning", pa.string()), pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int32()), pa.field("completion_tokens", pa.int32()),
    pa.field("output_ids", pa.list_(pa.int32())), pa.field("profile", pa.string()),
]
SHARD_ROWS = 100_000


def _text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else orjson.dumps(value).decode()


def _call(call: Any) -> dict[str, Any]:
    """One tool call in OpenAI's shape, its ``arguments`` as JSON text."""
    call = call if isinstance(call, dict) else {}
    fn = call.get("function") if isinstance(call.get("function"), dict) else {}
    return {"id": call.get("id"), "type": call.get("type") or "function",
            "function": {"name": fn.get("name"), "arguments": _text(fn.get("arguments"))}}


def hf_turn(m: dict[str, Any]) -> dict[str, Any]:
    """One message in the struct of :data:`_TURN` (a non-text content as JSON text)."""
    calls = m.get("tool_calls")
    if isinstance(calls, str):
        calls = orjson.loads(calls)
    return {"role": m.get("role"), "content": _text(m.get("content")),
            "reasoning_content": m.get("reasoning_content"),
            "tool_calls": [_call(c) for c in calls] if calls else None,
            "tool_call_id": m.get("tool_call_id"), "name": _text(m.get("name"))}


def hf_row(rec: dict[str, Any], sent: Sent) -> dict[str, Any]:
    """One answered data-set row in the export's schema (its kept columns last)."""
    conv = conversation(sent, rec)
    tools = sent.tools or row_tools(rec)
    sample = rec.get("sample") or 0
    return {"id": content_id(conv[:-1], tools, sample, conv[-1]), "input_id": rec["id"],
            "sample": sample, "conversations": [hf_turn(m) for m in conv],
            "tools": orjson.dumps(tools).decode() if tools else None,
            "completion": rec.get("completion"), "reasoning": rec.get("reasoning"),
            "finish_reason": rec.get("finish_reason"),
            "prompt_tokens": rec.get("prompt_tokens"),
            "completion_tokens": rec.get("completion_tokens"),
            "output_ids": rec.get("output_ids"), "profile": rec.get("profile"),
            **kept_columns(rec)}


def _yaml_info(schema: pa.Schema, rows: int, nbytes: int) -> dict[str, Any]:
    try:
        import datasets
    except ImportError as exc:
        raise JobError("the hf export needs datasets: pip install 'gpu-batch-fleet[export]'"
                       " (or pip install datasets)") from exc
    info = datasets.DatasetInfo(
        features=datasets.Features.from_arrow_schema(schema),
        splits=datasets.SplitDict({"train": datasets.SplitInfo(
            name="train", num_examples=rows, num_bytes=nbytes)}))
    return info._to_yaml_dict()


def verdict(data: DataSet) -> str:
    """What ``fleet verify`` says of the data set, as its manifest recorded it at commit."""
    if not data.manifest.get("complete"):
        return "verify fails (exit 1): rows are missing"
    failed = data.failed_gates()
    if failed:
        return ("verify fails (exit 5): quality gates failed: "
                + "; ".join(gate_line(g) for g in failed))
    return "verify passes (exit 0): every row there once, every quality gate passed"


def card(data: DataSet, schema: pa.Schema, rows: int, nbytes: int, errors_name: str,
         license_id: str, usable_only: bool) -> str:
    """The dataset card: YAML metadata, then the job's model, sampling, verdict and quality."""
    import yaml

    meta = {"license": license_id,
            "configs": [{"config_name": "default", "data_files": [
                {"split": "train", "path": "data/train-*.parquet"}]}],
            "dataset_info": _yaml_info(schema, rows, nbytes),
            "tags": ["speculative-decoding", "synthetic", "regenerated"]}
    m = data.manifest
    counts, totals = m.get("counts", {}), m.get("totals", {})
    ok = int(counts.get("ok", 0)) + int(counts.get("truncated", 0))
    models = ", ".join(f"`{v}` ({k})" for k, v in sorted(data.models().items())) or "unknown"
    sampling = orjson.dumps(data.sampling, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2
                            ).decode()
    mean = totals.get("completion_tokens", 0) / ok if ok else 0.0
    left_out = ("failed, quarantined and rows that fail a row-level quality gate "
                "(--usable-only)" if usable_only else "failed and quarantined rows")
    body = [
        f"# {data.job}: completions regenerated by the fleet", "",
        f"- **Model**: {models}",
        f"- **Verdict**: {verdict(data)}",
        f"- **Rows**: {rows:,} (prompt, sample) rows of {data.rows:,} in the data set; "
        f"{left_out} are listed with their reasons in `{errors_name}` beside this folder",
        f"- **Quality**: {counts.get('ok', 0):,} finished, {counts.get('truncated', 0):,} "
        f"truncated at the token limit (`finish_reason` \"length\"), "
        f"{counts.get('failed', 0):,} failed and {counts.get('quarantined', 0):,} quarantined",
        f"- **Tokens**: {totals.get('prompt_tokens', 0):,} prompt, "
        f"{totals.get('completion_tokens', 0):,} completion ({mean:,.1f} per answered row)",
        f"- **Data set digest**: `{m.get('digest', '')}` (finished {m.get('finished_at', '')})",
        "", "## Sampling", "", "```json", sampling, "```", "",
        "## Columns", "",
        "`conversations` holds the messages the engine was sent, then the generated assistant "
        "turn (`reasoning_content` apart from `content`; `tool_calls` in OpenAI's shape, "
        "`function.arguments` as JSON text); `tools` is the request's tools as JSON text; "
        "`output_ids` are the engine's own sampled token ids where it returned them. To train "
        "a drafter on the engine's exact tokens, export `--format specforge` or "
        "`--format speculators` (docs/output.md).", "",
    ]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n\n" + "\n".join(body)


def write_hf(data: DataSet, out: Path, run: ExportRun) -> Tally:
    """Write the folder ``out`` (shards and card) and ``out.errors.jsonl``."""
    tally = Tally()
    schema = with_kept(HF_FIELDS, data.kept_fields(), "hf")
    sent = data.requests
    with atomic_dir(out) as tmp, error_file(out) as errors, data.tables() as tables:
        (tmp / "data").mkdir()
        parts: list[Path] = []
        writer: pq.ParquetWriter | None = None
        in_part = 0
        for table in tables:
            ok = [hf_row(rec, sent.get(rec)) for rec in errors.usable(table.to_pylist(), run.judge)]
            if not ok:
                continue
            if writer is None or in_part >= SHARD_ROWS:
                if writer is not None:
                    writer.close()
                parts.append(tmp / "data" / f"part-{len(parts):05d}.parquet")
                writer, in_part = pq.ParquetWriter(parts[-1], schema, compression="zstd"), 0
            writer.write_table(pa.Table.from_pylist(ok, schema=schema))
            in_part += len(ok)
            tally.ok += len(ok)
        if writer is not None:
            writer.close()
        if not parts:
            parts.append(tmp / "data" / "part-00000.parquet")
            pq.write_table(schema.empty_table(), parts[0])
        nbytes = 0
        for n, part in enumerate(parts):
            nbytes += part.stat().st_size
            part.rename(part.with_name(f"train-{n:05d}-of-{len(parts):05d}.parquet"))
        (tmp / "README.md").write_text(card(data, schema, tally.ok, nbytes,
                                            errors_path(out).name, run.license,
                                            run.judge is not None))
        tally.errors = errors.count
    tally.lines = tally.ok
    tally.extra = {"shards": len(parts)}
    return tally
