"""``fleet export --format openai-batch``: one line per prompt, as an OpenAI Batch output file.

The lines follow the OpenAI Batch output file: ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}``; the body is a
``chat.completion`` for chat rows and a ``text_completion`` for plain prompts. A failed row is
a per-request failure, which that format reports in the response (the OpenAPI schema
``BatchRequestOutput`` of openai-openapi: ``error`` is only "for requests that failed with a
non-HTTP error"): ``"response": {"status_code": 400 | 500, "request_id", "body": {"error":
{"message", "type", "param", "code"}}}, "error": null``; 400 with ``invalid_request_error`` for
quarantined rows, 500 with ``server_error`` for generation failures. Every id is derived from
the job and row index, so an export is reproducible.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson

from producer.exports.source import DataSet, ExportRun, Tally, atomic_file, kept_columns
from workers.dataset.manifest import row_bucket


def _ids(job: str, index: int) -> str:
    return hashlib.sha256(f"{job}\0{index}".encode()).hexdigest()[:24]


def _choice(rec: dict[str, Any], chat: bool) -> dict[str, Any]:
    """One sample of a row as an OpenAI choice (its ``index`` is the sample)."""
    index = rec.get("sample") or 0
    if not chat:
        return {"index": index, "text": rec["completion"], "logprobs": None,
                "finish_reason": rec["finish_reason"]}
    message: dict[str, Any] = {"role": "assistant", "content": rec["completion"]}
    if rec["reasoning"] is not None:
        message["reasoning_content"] = rec["reasoning"]
    if rec.get("tool_calls"):
        message["tool_calls"] = orjson.loads(rec["tool_calls"])
    return {"index": index, "message": message, "logprobs": None,
            "finish_reason": rec["finish_reason"]}


def _body(recs: list[dict[str, Any]], rid: str, created: int, model: str, chat: bool
          ) -> dict[str, Any]:
    """The response body of one prompt: one choice per sample that finished (as OpenAI's
    ``n``); the prompt's tokens counted once, the completions' summed."""
    rec = recs[0]
    completion = sum(r["completion_tokens"] or 0 for r in recs)
    usage = {"prompt_tokens": rec["prompt_tokens"] or 0, "completion_tokens": completion,
             "total_tokens": (rec["prompt_tokens"] or 0) + completion}
    choices = [_choice(r, chat) for r in recs]
    if not chat:
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created,
                "model": model, "choices": choices, "usage": usage}
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created,
            "model": model, "choices": choices, "usage": usage}


def openai_line(rec: dict[str, Any] | list[dict[str, Any]], created: int,
                models: dict[str, str], chat_prompts: bool = False) -> dict[str, Any]:
    """One prompt's data-set rows (its samples) as a line of an OpenAI Batch output file;
    kept input columns under ``columns``. A prompt none of whose samples finished is reported
    with the first one's error. ``chat_prompts``: the job sent plain prompts as chat
    requests (``--chat``), so they were answered as chats, reasoning apart."""
    recs = rec if isinstance(rec, list) else [rec]
    done = [r for r in recs if r["status"] == "ok"]
    rec = done[0] if done else recs[0]
    rid = _ids(rec["job"], rec["index"])
    line: dict[str, Any] = {"id": f"batch_req_{rid}", "custom_id": rec["id"]}
    if kept := kept_columns(rec):
        line["columns"] = kept
    if not done:
        status, kind, code = ((400, "invalid_request_error", "quarantined")
                              if row_bucket(rec) == "quarantined"
                              else (500, "server_error", "generation_failed"))
        body = {"error": {"message": rec["error"], "type": kind, "param": None, "code": code}}
        return line | {"response": {"status_code": status, "request_id": f"req_{rid}",
                                    "body": body}, "error": None}
    model = models.get(rec["profile"] or "", rec["profile"] or "")
    chat = rec["messages"] is not None or rec["prompt"] is None or chat_prompts
    body = _body(done, rid, created, model, chat)
    return line | {"response": {"status_code": 200, "request_id": f"req_{rid}", "body": body},
                   "error": None}


def write_openai_batch(data: DataSet, out: Path, run: ExportRun | None = None) -> Tally:
    """Write one line per prompt (its samples as the choices); ``lines`` counts the lines,
    ``ok`` and ``errors`` the data-set rows (a failed row is reported inside its line)."""
    created = int(data.manifest.get("finished_at_unix") or 0)
    models, tally, chat = data.models(), Tally(), bool(data.sampling.get("chat"))
    prompt: list[dict[str, Any]] = []  # the samples of one prompt (consecutive in the data set)
    with atomic_file(out) as tmp, tmp.open("wb") as fh, data.tables() as tables:

        def emit() -> None:
            if prompt:
                line = openai_line(prompt, created, models, chat)
                fh.write(orjson.dumps(line, default=str) + b"\n")
                tally.lines += 1
                prompt.clear()

        for table in tables:
            for rec in table.to_pylist():
                if prompt and prompt[0]["index"] != rec["index"]:
                    emit()
                prompt.append(rec)
                if rec["status"] == "ok":
                    tally.ok += 1
                else:
                    tally.errors += 1
        emit()
    return tally
