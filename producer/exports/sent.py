"""What the worker sent the engine for a data-set row, rebuilt from the staged input.

The data set keeps each message's role and content only; the request itself also carried the
messages' other fields (an earlier turn's ``tool_calls``, a tool message's ``tool_call_id``),
the row's ``tools`` and its chat-template keywords. The exports that must give the engine's
own tokens read the staged batch input (``jobs/<job>/inputs/``) and build the request again
with the worker's own functions: :func:`workers.batch.prompt_sampling.sampling_of`,
:func:`workers.engine.client.chat_messages` and :func:`workers.engine.client.chat_body`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from workers.batch.prompt_sampling import sampling_of
from workers.dataset.jobs import JobSpec, PromptRow, SamplingSpec, load_batch_input
from workers.dataset.store import Store
from workers.engine.client import chat_body, chat_messages


@dataclass(frozen=True)
class Sent:
    """One request as the engine got it: chat ``messages`` (None for a plain ``/generate``
    prompt, then ``prompt``), the request's ``tools`` and the template keywords."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    tools: list[Any] | None
    template_kwargs: dict[str, Any]


# Staged batches kept read: a row group of the data set spans a few, and an export may pass
# over a group twice (--usable-only's judge, then the training rows).
KEPT_BATCHES = 4


class SentRequests:
    """Staged inputs of a job, read a batch at a time (rows come in batch order), the last
    :data:`KEPT_BATCHES` kept."""

    def __init__(self, store: Store, spec: JobSpec) -> None:
        self.store, self.spec = store, spec
        self._batches: OrderedDict[int, dict[int, PromptRow]] = OrderedDict()

    def row(self, batch: int, index: int) -> PromptRow:
        """The staged input row ``index`` of ``batch``."""
        rows = self._batches.get(batch)
        if rows is None:
            rows = {r.index: r for r in load_batch_input(self.store, self.spec.name, batch)}
            self._batches[batch] = rows
            if len(self._batches) > KEPT_BATCHES:
                self._batches.popitem(last=False)
        else:
            self._batches.move_to_end(batch)
        return rows[index]

    def get(self, rec: dict[str, Any]) -> Sent:
        """The request of data-set row ``rec`` (its ``batch``, ``index`` and ``sample``)."""
        row = self.row(int(rec["batch"]), int(rec["index"]))
        return request_of(self.spec.sampling, row, int(rec.get("sample") or 0))


def request_of(job: SamplingSpec, row: PromptRow, sample: int = 0) -> Sent:
    """The request the worker sends for sample ``sample`` of ``row`` under the job's options."""
    sampling = sampling_of(job, row, sample)
    messages = chat_messages(row.prompt, row.messages, sampling)
    if messages is None:
        return Sent(row.prompt or "", None, None, {})
    body = chat_body(messages, sampling)
    kwargs = dict(body.get("chat_template_kwargs") or {})
    if body.get("reasoning_effort") is not None:
        kwargs["reasoning_effort"] = body["reasoning_effort"]
    return Sent(None, [dict(m) for m in messages], _tools(body), kwargs)


def _tools(body: dict[str, Any]) -> list[Any] | None:
    """The tools the chat template was given: every one, only the one a named ``tool_choice``
    picks, none for ``tool_choice: "none"`` (SGLang ``OpenAIServingChat._process_messages``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        return [t for t in tools if (t.get("function") or {}).get("name") == name]
    return list(tools)
