"""The fleet's exception tree.

    FleetError
    ├── InputError(path, line, reason)      a prompt file cannot be read (CLI exit code 2)
    ├── EngineError
    │   ├── EngineStartFailed                the engine exited or never became healthy
    │   ├── EngineUnavailable                the engine is gone: restart it, retry the request
    │   │   └── PromptFailed                 a live engine answered 500 to this prompt: a few
    │   │                                    tries, then the row fails (never an outage)
    │   └── PromptRejected(reason)           the engine refused this prompt: quarantine it
    ├── StoreError                           the result store failed (transient unless said)
    └── JobError                             a job record is missing or contradicts the input

Boundary modules (engine_client, store) translate httpx/botocore/OS errors into these types,
so nothing above them catches a third-party exception.
"""

from __future__ import annotations


class FleetError(Exception):
    """Root of every error the fleet raises on purpose."""


class InputError(FleetError):
    """A prompt file (or one of its lines) cannot be read."""

    def __init__(self, path: str, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {reason}")


class EngineError(FleetError):
    """Something went wrong with the inference engine."""


class EngineStartFailed(EngineError):
    """The engine process exited or did not become healthy in time."""


class EngineUnavailable(EngineError):
    """The engine cannot be reached or answered with a server error."""

    # Tries before the row is recorded failed; None: the job's retry policy decides.
    max_attempts: int | None = None


class PromptFailed(EngineUnavailable):
    """The engine answered HTTP 500 to this prompt.

    SGLang's ``/generate`` catches only ValueError (``http_server.generate_request``): anything
    else a prompt triggers, such as the TypeError of a sampling key ``SamplingParams`` does not
    take, is a bare 500 while the server stays healthy. If ``/health`` is fine, the prompt fails
    after ``max_attempts`` tries instead of being retried as an outage.
    """

    max_attempts = 3


class PromptRejected(EngineError):
    """The engine refused a prompt (too long, bad parameters): never retry it."""


# How a stored row's error begins when the row is quarantined rather than failed
# (workers/dataset/manifest.py, row_bucket): the engine refused the prompt (its 400), the
# prompt cannot fit the model's context (found at enqueue: producer/context_limit.py), or it
# crashed the engine again and again (workers/batch/runner.py).
ENGINE_REJECTED = "engine rejected the prompt:"
TOO_LONG = "too long for the context:"
POISON = "poison prompt"
QUARANTINE_PREFIXES = (ENGINE_REJECTED, TOO_LONG, POISON)


class StoreError(FleetError):
    """The result store failed to read or write an object."""


class JobError(FleetError):
    """A job record is missing or does not match the input."""
