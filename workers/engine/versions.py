"""The SGLang versions this fleet supports, what differs between them, and the check at start.

Supported are the releases whose formats and capacity arithmetic were read from the published
wheels and have fixtures under ``tests/fixtures/sglang/<version>/``: 0.5.10.post1 and 0.5.11.
Any other version is refused when a worker's engine becomes healthy (one line naming the
version), because the log lines, metrics and pool arithmetic the tuner and the heartbeat read
are known to move between releases: 0.5.23 prints ``KV Cache is allocated. dtype: …, #tokens:
…`` and sizes its pools in ``mem_cache/kv_cache_configurator.py`` with other rules (an explicit
running cap becomes ``min(cap, tokens // 2)``, lazy extra buffers change the Mamba ratio).

Differences between the two supported releases (all read from their sources):

- ``SGLANG_ENABLE_SPEC_V2`` defaults to False in 0.5.10.post1 and True in 0.5.11
  (``srt/environ.py``), which keeps the overlap scheduler on with EAGLE/MTP at ``topk == 1``.
- The ``Prefill batch`` line gains ``#pending-token: N,`` in 0.5.11
  (``observability/scheduler_metrics_mixin.py::log_prefill_stats``).
- 0.5.11 computes the speculative accept rate of the decode line and gauge as
  ``(accepted - steps) / (steps * (draft - 1))`` (``log_decode_stats``); the tuner reads the
  accept length, which both releases compute alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from workers.errors import EngineStartFailed

# pip requirement matching exactly the supported releases (pyproject's ``gpu`` extra).
PIP_RANGE = "sglang>=0.5.10.post1,<0.5.11.post1"


@dataclass(frozen=True)
class VersionTraits:
    """What one supported SGLang release does differently."""

    version: str
    spec_v2_default: bool
    prefill_pending_token: bool


SUPPORTED: dict[str, VersionTraits] = {
    "0.5.10.post1": VersionTraits("0.5.10.post1", False, False),
    "0.5.11": VersionTraits("0.5.11", True, True),
}
# The version the simulator plays and the tuner assumes when a snapshot does not say.
DEFAULT_VERSION = "0.5.11"


class UnsupportedVersion(EngineStartFailed):
    """The engine runs an SGLang release this fleet has no formats or arithmetic for."""


def supported_list() -> str:
    """The supported versions as one comma-separated string."""
    return ", ".join(SUPPORTED)


def traits(version: str | None) -> VersionTraits | None:
    """The traits of ``version``, or None when it is not supported (or unknown)."""
    return SUPPORTED.get(version or "")


def check_version(version: str | None, where: str) -> VersionTraits:
    """The traits of a supported ``version``; raise UnsupportedVersion with one line otherwise."""
    found = traits(version)
    if found is not None:
        return found
    shown = f"SGLang {version}" if version else "an SGLang version it does not report"
    raise UnsupportedVersion(
        f"{where} runs {shown}, which this fleet does not support (supported: "
        f"{supported_list()}; install {PIP_RANGE!r})"
    )


def engine_version(server_info: dict[str, Any] | None) -> str | None:
    """The ``version`` field of a /server_info document (``http_server.get_server_info``)."""
    version = (server_info or {}).get("version")
    return str(version) if version else None


def require_supported_engine(base_url: str, gpu: int) -> VersionTraits:
    """Read ``version`` from the healthy engine's /server_info and refuse an unsupported one."""
    try:
        resp = httpx.get(f"{base_url}/server_info", timeout=10.0)
        info = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        info = None
    return check_version(engine_version(info), f"engine on GPU {gpu}")
