"""What a ``fleet_relaunch`` control message may ask of a worker, and nothing more.

Anyone who can write to Redis can broadcast a remote-control command, so the message is
treated as hostile. It may only:

- name a profile this worker already knows (``config/profiles/<name>.toml``, its current
  profile, or one it validated earlier), in which case the worker's own copy is used and the
  message's flags must not differ from it (no model swapped under an unchanged name); or
- name a new profile (the tuner's ``<base>-tuneN``) whose flags differ from a known profile
  only in the tuner's levers (``workers/tune/levers.py``), each value checked.

The environment always comes from the worker's copy of the base profile: a message whose
``env`` differs from it is refused (no environment variable crosses the wire). The resulting
profile is built here, from local data plus vetted lever values, never taken from the wire.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from pydantic import ValidationError

from config.launch_profile import PROFILES_DIR, FlagValue, LaunchProfile, ProfileError, load_profile

# A profile name: what config/profiles/ and the tuner's "-tuneN" names use; never a path.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MAX_DESCRIPTION = 300
MAX_CLIENT_CONCURRENCY = 4096

WIRE_KEYS = frozenset({"name", "description", "flags", "env", "client_concurrency"})


class RelaunchRefused(ValueError):
    """A relaunch message asks for something the worker does not allow."""


def _int_in(lo: int, hi: int) -> Callable[[FlagValue], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _one_of(*choices: str) -> Callable[[FlagValue], bool]:
    return lambda v: isinstance(v, str) and v in choices


def _flag_on(v: FlagValue) -> bool:
    return v is True


def _fraction(v: FlagValue) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.1 <= v <= 0.98


# The flags the tuner's levers change (workers/tune/levers.py: running cap and Mamba slots,
# NO_RADIX, BF16_SSM, FP8_KV, raised_fraction), with the values each may take. Choices follow
# SGLang's ServerArgs (sglang/srt/server_args.py, v0.5.x: --mamba-scheduler-strategy,
# --mamba-ssm-dtype, --kv-cache-dtype). None (flag removed) is always allowed for a lever.
LEVERS: dict[str, Callable[[FlagValue], bool]] = {
    "max-running-requests": _int_in(1, 65536),
    "max-mamba-cache-size": _int_in(1, 1_000_000),
    "mem-fraction-static": _fraction,
    "disable-radix-cache": _flag_on,
    "mamba-scheduler-strategy": _one_of("auto", "no_buffer", "extra_buffer"),
    "mamba-ssm-dtype": _one_of("float32", "bfloat16", "float16"),
    "kv-cache-dtype": _one_of("auto", "fp8_e4m3", "fp8_e5m2", "bfloat16", "bf16"),
}


def check_name(name: object) -> str:
    """``name`` if it is a plain profile name (full match), else RelaunchRefused."""
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        raise RelaunchRefused(f"profile name {name!r} is not a plain name "
                              f"([A-Za-z0-9._-], at most 100 characters)")
    return name


def local_profile(name: str) -> LaunchProfile | None:
    """``config/profiles/<name>.toml`` on this worker, or None."""
    if not (PROFILES_DIR / f"{name}.toml").is_file():
        return None
    try:
        return load_profile(name)
    except (ProfileError, ValidationError):
        return None


def _parse(payload: object) -> LaunchProfile:
    if not isinstance(payload, dict):
        raise RelaunchRefused("the relaunch message must be a JSON object")
    unknown = sorted(set(payload) - WIRE_KEYS)
    if unknown:
        raise RelaunchRefused(f"unknown keys in the relaunch message: {', '.join(unknown)}")
    check_name(payload.get("name"))
    try:
        return LaunchProfile.model_validate(payload)
    except ValidationError as exc:
        raise RelaunchRefused(f"malformed profile: {exc.errors()[0]['msg']}") from None


def _bad_levers(base: LaunchProfile, wanted: LaunchProfile) -> list[str]:
    """Flags that differ from ``base`` and are not levers with an allowed value."""
    bad = []
    for key in sorted(set(base.flags) | set(wanted.flags)):
        old, new = base.flags.get(key), wanted.flags.get(key)
        if old == new:
            continue
        check = LEVERS.get(key)
        if check is None or (new is not None and not check(new)):
            bad.append(f"{key}={new!r}")
    return bad


def _merged(base: dict[str, FlagValue], wanted: dict[str, FlagValue]) -> dict[str, FlagValue]:
    """The base's flags (its own values) with the vetted lever values of ``wanted``."""
    flags = {k: v for k, v in base.items() if k not in LEVERS or k in wanted}
    flags.update({k: v for k, v in wanted.items() if k in LEVERS})
    return flags


def _concurrency(value: int | None) -> int | None:
    if value is not None and not 1 <= value <= MAX_CLIENT_CONCURRENCY:
        raise RelaunchRefused(f"client_concurrency {value} outside 1..{MAX_CLIENT_CONCURRENCY}")
    return value


def vet(payload: object, known: Iterable[LaunchProfile]) -> LaunchProfile:
    """The profile a relaunch ``payload`` may start, built from this worker's own profiles.

    ``known`` are the profiles this worker already trusts (its current one first); profiles
    under ``config/profiles/`` are known too. Raises RelaunchRefused with one line saying why.
    """
    wanted = _parse(payload)
    known = list(known)
    same = next((p for p in known if p.name == wanted.name), None) or local_profile(wanted.name)
    if same is not None:
        if wanted.flags and wanted.flags != same.flags:
            raise RelaunchRefused(f"profile {wanted.name!r} exists on this worker with other "
                                  "flags; a changed profile needs a new name")
        if wanted.env and wanted.env != same.env:
            raise RelaunchRefused("environment variables are not accepted over the wire")
        return same
    bases = known + [p for p in map(local_profile, _local_names()) if p is not None]
    errors: list[str] = []
    for base in bases:
        bad = _bad_levers(base, wanted)
        if not bad:
            if wanted.env and wanted.env != base.env:
                raise RelaunchRefused("environment variables are not accepted over the wire")
            return base.model_copy(update={
                "name": wanted.name, "description": wanted.description[:MAX_DESCRIPTION],
                "flags": _merged(base.flags, wanted.flags),
                "client_concurrency": _concurrency(wanted.client_concurrency)})
        errors.append(f"{base.name}: {', '.join(bad)}")
    raise RelaunchRefused(f"profile {wanted.name!r} changes flags outside the tuner's levers "
                          f"({'; '.join(errors[:1]) or 'no known base profile'})")


def _local_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))
