"""The units of a batch's run (one request each), and how a run ends early."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from workers.aio import cancel_and_wait
from workers.dataset.jobs import JobSpec, PromptRow
from workers.dataset.samples import prompt_units, row_samples, unit_key
from workers.errors import EngineError

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Unit:
    """One (prompt, sample) of a batch: what one request generates and one row stores."""

    row: PromptRow
    sample: int = 0
    samples: int = 1  # the prompt's samples in all

    @property
    def index(self) -> int:
        """The prompt's index in the job."""
        return self.row.index

    @property
    def key(self) -> str:
        """Its field in the batch's progress hash."""
        return unit_key(self.row.index, self.sample)

    @property
    def error(self) -> str | None:
        """Why the prompt was quarantined when it was read (None: it can be sent)."""
        return self.row.error


def units(spec: JobSpec, rows: list[PromptRow]) -> list[Unit]:
    """Every (prompt, sample) of ``rows``, prompt by prompt (dataset/samples.prompt_units)."""
    job = spec.sampling.samples
    return [Unit(row, s, row_samples(row.params, job)) for row, s in prompt_units(rows, job)]


class HandBack(EngineError):
    """The batch goes back to the queue with its answered prompts kept (the worker stops)."""


class EngineDown(HandBack):
    """The engine did not come back within the wait: another GPU can take the batch."""


class JobStopped(EngineError):
    """The job was cancelled while this batch ran: stop sending, keep what is recorded."""


async def gather_or_cancel(aws: list[Awaitable[T]]) -> list[T]:
    """Run all; on the first exception cancel the others and re-raise it."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await cancel_and_wait(*tasks)
        raise
