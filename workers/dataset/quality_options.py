"""What the quality measurement needs from a job (:class:`QualityOptions`): the near-empty
threshold, which rows are of thinking mode, whether samples are drawn at temperature > 0, and
the structured output the job and the rows in view ask for (workers/dataset/quality.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.dataset.row_form import Constraint, constraint_of


@dataclass
class QualityOptions:
    """What the measurement needs from the job: the near-empty threshold, whether a row is of
    thinking mode, whether the job's samples are drawn at temperature > 0, the structured
    output the job asks for, and that of the rows in view that ask for their own
    (``row_constraints``: index -> constraint, from the staged rows' ``params``)."""

    near_empty_tokens: int = 10
    thinking: Callable[[dict[str, Any]], bool] = lambda row: False
    sampled: bool = False
    job_constraint: Constraint | None = None
    row_constraints: dict[int, Constraint] = field(default_factory=dict)
    # Rows in view whose own request turned thinking off (their chat_template_kwargs'
    # enable_thinking false, or reasoning_effort "none"): not of thinking mode.
    row_no_thinking: set[int] = field(default_factory=set)

    def is_thinking(self, row: dict[str, Any]) -> bool:
        """Whether ``row`` is of thinking mode: the job's rule, unless its own request
        turned thinking off."""
        return self.thinking(row) and row.get("index") not in self.row_no_thinking

    def constraint(self, row: dict[str, Any]) -> Constraint | None:
        """The structured output ``row`` was asked for: its own, else the job's."""
        own = self.row_constraints.get(row.get("index"))  # type: ignore[arg-type]
        return own or self.job_constraint

    def any_constraint(self) -> bool:
        """Whether any row now in view may be a structured-output row."""
        return self.job_constraint is not None or bool(self.row_constraints)

    def add_rows(self, rows: list[dict[str, Any]] | None) -> None:
        """Staged rows (``index``, ``params``) now in view: their own structured output."""
        seen: dict[Constraint, Constraint] = {}
        for r in rows or ():
            params = r.get("params")
            if not params:
                continue
            if (c := constraint_of(params)) is not None:
                self.row_constraints[int(r["index"])] = seen.setdefault(c, c)
            if thinking_off(params):
                self.row_no_thinking.add(int(r["index"]))

    def clear_rows(self) -> None:
        """Forget the rows in view (:meth:`add_rows`)."""
        self.row_constraints = {}
        self.row_no_thinking = set()


def _reasoning_parser(profile: str) -> bool:
    """Whether launch profile ``profile`` sets ``--reasoning-parser`` (False if unreadable)."""
    from config.launch_profile import ProfileError, load_profile

    try:
        return bool(load_profile(profile).flag("reasoning-parser"))
    except (ProfileError, OSError, ValueError):
        return False


def thinking_off(params: dict[str, Any]) -> bool:
    """Whether request parameters turn thinking off (``chat_template_kwargs.enable_thinking``
    false, or ``reasoning_effort: "none"``, which SGLang maps to it)."""
    kwargs = params.get("chat_template_kwargs") or {}
    return (isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False) or \
        params.get("reasoning_effort") == "none"


def job_options(spec: Any, near_empty_tokens: int) -> QualityOptions:
    """The measurement's options for a job (a :class:`workers.dataset.jobs.JobSpec`): a row is
    of thinking mode when its engine's launch has a reasoning parser, it went through the chat
    route, and the job did not turn thinking off."""
    sampling = spec.sampling
    off = thinking_off({**sampling.params,
                        "chat_template_kwargs": sampling.chat_template_kwargs or {}})
    parsers: dict[str, bool] = {}

    def thinking(row: dict[str, Any]) -> bool:
        profile = row.get("profile")
        if off or not profile or not (sampling.chat or row.get("messages") is not None):
            return False
        if profile not in parsers:
            parsers[profile] = _reasoning_parser(profile)
        return parsers[profile]

    temperature = sampling.temperature
    sampled = spec.expected_samples != spec.total and (temperature is None or temperature > 0)
    return QualityOptions(near_empty_tokens, thinking, sampled, constraint_of(sampling.params))
