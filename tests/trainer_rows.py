"""A job of every row kind a drafter trains on, with the tokens the engine saw and produced.

Each row kind (a plain ``/generate`` prompt, chats with and without their own system message,
multi-turn inputs, a tool-call answer, tool-call history, a truncated answer, thinking on and
off per row, two samples per prompt) is answered under several chat templates (the fixture's;
one that primes ``<think>\\n`` as Qwen3.5/3.6's do; one that adds a default system prompt as
Qwen2.5's does; one that ends a turn with no newline). The engine's side is written out here
as SGLang does it (``serving_chat.py::_apply_jinja_template``: the messages as sent, history
tool-call arguments as objects, ``apply_chat_template(..., add_generation_prompt=True)``
encoded without added special tokens; ``tokenizer.encode(text)`` for ``/generate``), and what
it generated is what the model's template would print, except one answer whose ids are not
the canonical tokenization of its text (so the trainer must get the engine's ids, not the
text's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from tests.test_sink import local_root, make_job
from workers.dataset.jobs import PromptRow, SamplingSpec, encode_rows, result_key, save_spec
from workers.dataset.kept import encode_schema
from workers.dataset.store import LocalStore

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer"
BASE = json.loads((FIXTURE / "tokenizer_config.json").read_text())["chat_template"]
_GEN = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if "
        "enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>"
        "\\n\\n' }}{%- endif %}{%- endif %}")
assert BASE.endswith(_GEN)
TEMPLATES = {
    "fixture": BASE,
    # Qwen3.5/3.6: the generation prompt opens the think block the model then fills.
    "primed": BASE[:-len(_GEN)] + (
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if "
        "enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>"
        "\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"),
    # Qwen2.5: a default system message where the conversation has none.
    "default_system": ("{%- if messages[0]['role'] != 'system' and not tools %}{{- "
                       "'<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
                       "{%- endif %}" + BASE),
    # A turn ends at its end token: nothing after it.
    "no_newline": BASE.replace("'<|im_end|>\\n'", "'<|im_end|>'"),
    # DeepSeek-R1's way: a generated turn's reasoning is not printed back.
    "drops_reasoning": BASE.replace(
        "{%- if message['role'] == 'assistant' and message.get('reasoning_content') is not none "
        "%}{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}{%- endif %}",
        ""),
}
assert TEMPLATES["drops_reasoning"] != BASE
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
HISTORY_CALL = {"id": "call_9", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}


def tokenizer_folder(root: Path, template: str) -> Path:
    """A copy of the fixture tokenizer with chat template ``template``."""
    folder = root / f"tok-{template}"
    if not folder.exists():
        shutil.copytree(FIXTURE, folder)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["chat_template"] = TEMPLATES[template]
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def input_rows() -> list[PromptRow]:
    """One staged row per kind (index = kind)."""
    user = {"role": "user", "content": "What is 2+2?"}
    return [
        PromptRow(index=0, id="plain", prompt="def add(a, b):"),
        PromptRow(index=1, id="chat", messages=[user]),
        PromptRow(index=2, id="own-system", messages=[
            {"role": "system", "content": "You count."}, user]),
        PromptRow(index=3, id="multi-turn", messages=[
            user, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]),
        PromptRow(index=4, id="tool-call", messages=[
            {"role": "user", "content": "Weather in Oslo?"}], params={"tools": TOOLS}),
        PromptRow(index=5, id="tool-history", messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [HISTORY_CALL]},
            {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}],
            params={"tools": TOOLS}),
        PromptRow(index=6, id="truncated", messages=[user]),
        PromptRow(index=7, id="no-thinking", messages=[user],
                  params={"chat_template_kwargs": {"enable_thinking": False}}),
    ]


def _sent(row: PromptRow) -> tuple[list[dict[str, Any]] | None, list[Any] | None, dict]:
    """What SGLang rendered for ``row``: messages (history tool-call arguments as objects),
    tools and template keywords (the job has no --system-prompt: a template's default one
    is the engine's context too)."""
    if row.messages is None:
        return None, None, {}
    messages = [dict(m) for m in row.messages]
    for m in messages:
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
    return messages, row.params.get("tools"), dict(row.params.get("chat_template_kwargs") or {})


def _answer(row: PromptRow, sample: int) -> dict[str, Any]:
    """What the parsers made of the generated text: content, reasoning, tool calls."""
    if row.id == "plain":
        return {"completion": f"\n    total = a + b\n    print(total, {sample})\n    return total",
                "reasoning": None}
    if row.id == "tool-call":
        call = {"id": f"call_{sample}", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}
        return {"completion": "", "reasoning": f"need the tool {sample}",
                "tool_calls": orjson.dumps([call]).decode(), "finish_reason": "tool_calls"}
    if row.id == "truncated":
        return {"completion": "", "reasoning": f"Let me think about {sample} and",
                "finish_reason": "length"}
    if row.id == "no-thinking":
        return {"completion": f"Four: two and two make four, as {row.id} sample {sample} says.",
                "reasoning": None}
    return {"completion": f"It is {4 + sample}: two and two make four, says {row.id}.",
            "reasoning": f"add the numbers {sample}"}


def engine_tokens(tok: Any, row: PromptRow, ans: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(the context ids the engine saw, the ids it generated) for one answer."""
    messages, tools, kwargs = _sent(row)
    if messages is None:
        ctx = tok.encode(row.prompt)
        return ctx, tok.encode(ans["completion"], add_special_tokens=False) + [tok.eos_token_id]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                   add_generation_prompt=True, **kwargs)
    ctx = tok.encode(text, add_special_tokens=False)
    turn = {"role": "assistant", "content": ans["completion"]}
    if ans.get("reasoning") is not None:
        turn["reasoning_content"] = ans["reasoning"]
    if ans.get("tool_calls"):
        turn["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
            c["function"]["arguments"])}} for c in json.loads(ans["tool_calls"])]
    full = tok.apply_chat_template([*messages, turn], tools=tools, tokenize=False,
                                   add_generation_prompt=False, **kwargs)
    n = 0
    while n < min(len(text), len(full)) and text[n] == full[n]:
        n += 1
    generated = full[n:]
    if ans.get("reasoning") and ans["reasoning"] not in generated:  # the template drops it
        generated = f"<think>\n{ans['reasoning']}\n</think>\n\n{generated}"
    end = generated.rfind("<|im_end|>")
    if ans.get("finish_reason") == "length":
        last = ans["completion"] or ans["reasoning"]
        generated = generated[:generated.rfind(last) + len(last)]
    else:
        generated = generated[:end + len("<|im_end|>")]
    if row.id == "multi-turn":  # the model spelled one word of its answer letter by letter
        at = generated.index(ans["completion"])
        words = tok.tokenize(ans["completion"])
        k = next(i for i, w in enumerate(words) if len(w) > 1)
        spelled = [*words[:k], *words[k], *words[k + 1:]]
        return ctx, (tok.encode(generated[:at], add_special_tokens=False)
                     + tok.convert_tokens_to_ids(spelled)
                     + tok.encode(generated[at + len(ans["completion"]):],
                                  add_special_tokens=False))
    return ctx, tok.encode(generated, add_special_tokens=False)


def make_trainer_job(env: dict[str, str], tok: Any, name: str = "kinds"
                     ) -> dict[tuple[str, int], tuple[list[int], list[int]]]:
    """Stage and answer the job ``name`` (two samples per prompt; kept columns ``topic`` and
    ``score``);
    return (input id, sample) -> (input_ids, loss_mask) as the engine's tokens make them."""
    store = LocalStore(local_root(env))
    rows = input_rows()
    spec = make_job(store, name, rows, batch_size=4, missing=(0, 1),
                    sampling=SamplingSpec(max_new_tokens=64, samples=2))
    kept = pa.schema([pa.field("topic", pa.string()), pa.field("score", pa.int64())])
    spec = spec.model_copy(update={"total_samples": 2 * len(rows), "keep_schema": encode_schema(
        kept), "keep_columns": {f.name: str(f.type) for f in kept}})
    save_spec(store, spec)
    truth = {}
    for batch in range(spec.n_batches):
        got = []
        for row in rows[batch * 4:(batch + 1) * 4]:
            for sample in range(2):
                ans = _answer(row, sample)
                ctx, out = engine_tokens(tok, row, ans)
                truth[(row.id, sample)] = (ctx + out, [0] * len(ctx) + [1] * len(out))
                got.append({
                    "job": name, "batch": batch, "index": row.index, "id": row.id,
                    "sample": sample, "prompt": row.prompt, "messages": row.messages,
                    "finish_reason": "stop", **ans, "output_ids": out,
                    "prompt_tokens": len(ctx), "completion_tokens": len(out),
                    "latency_s": 0.5, "status": "ok", "error": None, "profile": "qwen36-27b",
                    "gpu": 0, "node": "gpu0@test",
                    "keep": {"topic": f"topic of {row.id}", "score": row.index}})
        store.put(result_key(name, batch), encode_rows(got, compress=False))
    return truth
