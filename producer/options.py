"""``enqueue``'s job-level request options, checked and turned into the job's SamplingSpec."""

from __future__ import annotations

from typing import Any

import orjson

from workers.dataset.jobs import SamplingSpec, load_spec
from workers.dataset.store import Store
from workers.engine.sampling import SamplingError, job_params, translate
from workers.errors import InputError, JobError

NAMED = ("max_new_tokens", "temperature", "top_p")


def _template_kwargs(raw: str | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InputError("--chat-template-kwargs", None, f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InputError("--chat-template-kwargs", None, "must be a JSON object")
    return value


def _merge_named(named: dict[str, Any], params: dict[str, Any]) -> None:
    """Move max_new_tokens / temperature / top_p given with --sampling to their own fields."""
    for key in NAMED:
        if key not in params:
            continue
        value = params.pop(key)
        if named[key] is not None and named[key] != value:
            raise InputError("--sampling", None, f"{key}={value} contradicts "
                             f"--{key.replace('_', '-')} {named[key]}")
        named[key] = value


def _samples(given: int | None, params: dict[str, Any]) -> int:
    """``--samples N`` and ``--sampling n=N`` (the same thing; they must agree)."""
    n = params.pop("n", None)
    if given is not None and n is not None and given != n:
        raise InputError("--sampling", None, f"n={n} contradicts --samples {given}")
    value = given if given is not None else n if n is not None else 1
    if value < 1:
        raise InputError("--samples", None, f"is {value}: the samples per prompt must be at "
                         "least 1")
    return value


def greedy_refusal(samples: int, temperature: Any) -> str | None:
    """Why N samples at this temperature are refused (None when they are not): greedy
    sampling (temperature 0) gives the same answer N times."""
    if samples > 1 and temperature is not None and temperature == 0:
        return (f"{samples} samples per prompt at temperature 0: greedy sampling gives "
                f"{samples} identical answers; set a temperature above 0 or 1 sample")
    return None


def job_sampling(*, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, sampling: list[str] | None = None,
                 chat: bool = False, system_prompt: str | None = None,
                 chat_template_kwargs: str | None = None, drop_unsupported: bool = False,
                 samples: int | None = None) -> SamplingSpec:
    """The job's SamplingSpec from the command line; InputError names a refused flag value.

    ``--system-prompt`` and ``--chat-template-kwargs`` only exist in chat requests, so they
    imply ``--chat``. ``--samples N`` (or ``--sampling n=N``) above 1 at temperature 0 is
    refused.
    """
    kwargs = _template_kwargs(chat_template_kwargs)
    chat = chat or system_prompt is not None or kwargs is not None
    try:
        params = job_params(sampling or [])
        translate(params, chat)  # keys a chat request has no field for
    except SamplingError as exc:
        raise InputError("--sampling", None, str(exc)) from None
    named: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                             "top_p": top_p}
    _merge_named(named, params)
    n = _samples(samples, params)
    if why := greedy_refusal(n, named["temperature"]):
        raise InputError("--samples", None, why)
    return SamplingSpec(**named, params=params, chat=chat, system_prompt=system_prompt,
                        chat_template_kwargs=kwargs, drop_unsupported=drop_unsupported,
                        samples=n)


# The enqueue flag of each SamplingSpec field (``--sampling`` keys are named one by one).
def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return orjson.dumps(value).decode() if isinstance(value, dict | list) else str(value)


def sampling_conflict(job: str, old: SamplingSpec, given: SamplingSpec) -> str:
    """One line naming each flag whose value differs from the job's, with both values (the
    job record's sampling fields are named as enqueue's flags: producer/enqueue_cmd.py)."""
    from producer.enqueue_cmd import flag_names

    flags = flag_names()
    diffs = [f"{flags[name]} {_shown(getattr(old, name))} (given {_shown(getattr(given, name))})"
             for name in SamplingSpec.model_fields
             if name in flags and getattr(old, name) != getattr(given, name)]
    for key in sorted(old.params.keys() | given.params.keys()):
        if old.params.get(key) != given.params.get(key):
            diffs.append(f"--sampling {key}={_shown(old.params.get(key))} "
                         f"(given {_shown(given.params.get(key))})")
    return (f"job {job!r} exists with other flags: {'; '.join(diffs)}; re-run with the "
            "job's flags (or none of them) to resume, or use a new job name")


def resumed_sampling(store: Store, job: str, given: SamplingSpec) -> SamplingSpec:
    """The recorded options of an existing job when none are given (a plain re-run resumes
    it, and its input must read as it did when the job was created)."""
    if given != SamplingSpec():
        return given
    try:
        return load_spec(store, job).sampling
    except JobError:
        return given


def dropped_note(dropped: dict[str, int]) -> str | None:
    """One line on the row keys that are not sent to the engine (None when there are none)."""
    if not dropped:
        return None
    listed = ", ".join(f"{k} ({n:,} row{'' if n == 1 else 's'})"
                       for k, n in sorted(dropped.items()))
    return (f"not sent to the engine: {listed}; 'user' and 'metadata' are OpenAI bookkeeping, "
            "other keys were dropped by --drop-unsupported-sampling (counts in the job record)")


def job_quality(fleet: str | None, given: list[str] | None) -> dict[str, float]:
    """A new job's quality gates: FLEET_QUALITY (comma-separated KEY=VALUE), then --quality."""
    from workers.dataset.quality_gates import parse_quality

    items = [x for x in (fleet or "").split(",") if x.strip()]
    return {**parse_quality(items, "FLEET_QUALITY"), **parse_quality(given)}
