"""The fleet's exception tree.

    FleetError
    ├── InputError(path, line, reason)      a prompt file cannot be read (CLI exit code 2)
    ├── EngineError
    │   ├── EngineStartFailed                the engine exited or never became healthy
    │   ├── EngineUnavailable                the engine is gone: restart it, retry the request
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


class PromptRejected(EngineError):
    """The engine refused a prompt (too long, bad parameters): never retry it."""


class StoreError(FleetError):
    """The result store failed to read or write an object."""


class JobError(FleetError):
    """A job record is missing or does not match the input."""
