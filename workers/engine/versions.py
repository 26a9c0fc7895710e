"""The SGLang releases this fleet supports and the check when a worker's engine becomes healthy.

Supported are 0.5.10.post1 through 0.5.23 (:mod:`workers.engine.releases` holds what each one
does differently, read from its published wheel). A release newer than the newest known one
starts with one warning line and is read with the newest known formats; what the tuner cannot
know about it is listed by :func:`unknown_traits`. A release older than 0.5.10.post1, or an
engine that does not report its version, is refused with one line: its log lines, metrics and
pool arithmetic are not known.

The effective running cap is read the same way in every release (``client.effective_cap``):
``/v1/loads`` ``loads[i].max_running_requests`` (``GetLoadsReqOutput`` through 0.5.12,
``LoadSnapshot`` core keys from 0.5.13, ``managers/scheduler_components/load_inquirer.py``),
then ``/server_info`` ``internal_states[i].effective_max_running_requests_per_dp``
(``managers/scheduler.py::get_internal_state``, ``scheduler_components/internal_state.py``
from 0.5.22).
"""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Any

import httpx

from workers.engine.releases import KNOWN, NEWEST, OLDEST, Traits, status, unknown_traits
from workers.engine.releases import traits as release_traits
from workers.errors import EngineStartFailed

__all__ = ["DEFAULT_VERSION", "PIP_RANGE", "SUPPORTED", "UnsupportedVersion", "VersionTraits",
           "check_version", "engine_version", "installed_version", "require_supported_engine",
           "supported_list", "traits", "unknown_traits", "version_warning"]

log = logging.getLogger(__name__)

# pip requirement of pyproject's ``gpu`` extra: every release from the oldest known on.
PIP_RANGE = f"sglang>={OLDEST},<0.6"
VersionTraits = Traits
SUPPORTED: dict[str, Traits] = {version: release_traits(version) for version in KNOWN}
# The version the simulator plays and the tuner assumes when a snapshot does not say.
DEFAULT_VERSION = "0.5.11"


class UnsupportedVersion(EngineStartFailed):
    """The engine runs an SGLang release older than the oldest this fleet knows."""


def supported_list() -> str:
    """The supported range as one string."""
    return f"{OLDEST} to {NEWEST}, and newer with a warning"


def traits(version: str | None) -> Traits | None:
    """The traits of ``version`` (a newer release's are the newest known ones), or None for
    an older release or no version."""
    if status(version) in ("older", "invalid"):
        return None
    return release_traits(version or NEWEST)


def version_warning(version: str | None, where: str) -> str | None:
    """The one warning line for a release that is not a known one but is accepted."""
    state = status(version)
    if state == "newer":
        return (f"{where} runs SGLang {version}, newer than {NEWEST} (the newest release "
                f"whose formats this fleet read); reading it as {NEWEST}")
    if state == "between":
        return (f"{where} runs SGLang {version}, not a published release; reading it as the "
                "nearest release before it")
    return None


def check_version(version: str | None, where: str) -> Traits:
    """The traits ``version`` is read with; raise UnsupportedVersion (one line) for a release
    older than :data:`~workers.engine.releases.OLDEST` or an engine that reports none."""
    found = traits(version)
    if found is not None:
        return found
    shown = f"SGLang {version}" if version else "an SGLang version it does not report"
    raise UnsupportedVersion(
        f"{where} runs {shown}, which this fleet does not support (supported: "
        f"{supported_list()}; install {PIP_RANGE!r})"
    )


def engine_version(server_info: dict[str, Any] | None) -> str | None:
    """The ``version`` field of a /server_info document (``http_server.server_info``)."""
    version = (server_info or {}).get("version")
    return str(version) if version else None


def installed_version() -> str | None:
    """The SGLang release installed in this environment (None without one)."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def require_supported_engine(base_url: str, gpu: int) -> Traits:
    """Read ``version`` from the healthy engine's /server_info: refuse an older release, log
    one warning for a newer one."""
    try:
        resp = httpx.get(f"{base_url}/server_info", timeout=10.0)
        info = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        info = None
    version = engine_version(info)
    where = f"engine on GPU {gpu}"
    found = check_version(version, where)
    warning = version_warning(version, where)
    if warning is not None:
        log.warning("%s", warning)
    return found
