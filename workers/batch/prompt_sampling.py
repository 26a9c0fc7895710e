"""What the engine gets for one prompt: the job's sampling options with the row's own on top.

Precedence: a row's own parameters override the job's (``--sampling``, ``--temperature``,
...), except the length: ``--max-new-tokens`` is a ceiling, so a row's OpenAI ``max_tokens`` /
``max_completion_tokens`` applies only when it is lower. A row's ``max_new_tokens`` (SGLang's
own name, what ``requeue-failed --max-new-tokens`` writes) replaces the ceiling for that row.
What SGLang accepts and how OpenAI's names map onto it is :mod:`workers.engine.sampling`.
"""

from __future__ import annotations

from workers.dataset.jobs import JobSpec, PromptRow, SamplingSpec
from workers.dataset.samples import row_samples, sample_seed
from workers.engine.client import Sampling
from workers.engine.sampling import Translated, route_fields, translate


def _ceiling(row: int | None, job: int | None) -> int | None:
    """``--max-new-tokens`` caps a row's own max_tokens."""
    return job if row is None else row if job is None else min(row, job)


def sampling_for(spec: JobSpec, row: PromptRow, sample: int = 0) -> Sampling:
    """What the engine gets for sample ``sample`` of ``row``: job options with the row's own
    on top (see above). When the row has more than one sample, each gets its own
    ``sampling_seed`` derived from (the job's or row's seed, the prompt, the sample), so the
    samples differ and a rerun draws them again (workers/dataset/samples.py)."""
    return sampling_of(spec.sampling, row, sample)


def sampling_of(js: SamplingSpec, row: PromptRow, sample: int = 0) -> Sampling:
    """:func:`sampling_for` from the job's sampling options alone (``enqueue`` has no job
    record yet when it counts a row against the context)."""
    chat = row.messages is not None or js.chat
    own = translate(row.params, chat, lenient=True)
    job_t = translate(js.params, chat, lenient=True)
    job = job_t.sampling
    own.chat = {**job_t.chat, **own.chat}  # e.g. --sampling json_schema=… as response_format
    for name in ("temperature", "top_p"):
        if getattr(js, name) is not None:
            job[name] = getattr(js, name)
    merged = {**job, **own.sampling}
    if row_samples(row.params, js.samples) > 1:
        prompt = row.messages if row.messages is not None else row.prompt
        merged["sampling_seed"] = sample_seed(merged.get("sampling_seed"), prompt, sample)
    max_new = merged.pop("max_new_tokens", None)
    if "max_new_tokens" not in row.params:  # OpenAI's names are capped by the job's
        max_new = _ceiling(max_new, js.max_new_tokens)
    temperature, top_p = merged.pop("temperature", None), merged.pop("top_p", None)
    kwargs = {**(js.chat_template_kwargs or {}), **(own.chat.get("chat_template_kwargs") or {})}
    if chat and kwargs:
        own.chat["chat_template_kwargs"] = kwargs
    extra, request = route_fields(Translated(merged, own.logprobs, own.chat), chat)
    return Sampling(max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                    extra=extra or None, request=request, chat=js.chat,
                    system_prompt=js.system_prompt if chat else None)
