"""Engine launch profiles: the SGLang flags (and environment) one engine is started with.

A profile is data, never a string of flags: the tuner produces a new ``LaunchProfile`` and the
engine lifecycle renders it with :meth:`LaunchProfile.to_argv`. The simulator accepts the same
flags, so both engines start from the same argv tail.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, Field

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"

FlagValue = str | int | float | bool | list[str | int | float]
# Flags that shape what a request's answer holds (SGLang's reasoning and tool-call parsers):
# a job enqueued for a profile with them needs an engine started with the same values.
OUTPUT_FLAGS = ("reasoning-parser", "tool-call-parser")


class ProfileError(ValueError):
    """A launch profile cannot be found or read."""


class LaunchProfile(BaseModel):
    """One engine launch configuration (SGLang server flags without host and port)."""

    name: str
    description: str = ""
    # SGLang flags by their long name without the leading dashes ("max-running-requests").
    flags: dict[str, FlagValue] = Field(default_factory=dict)
    # Extra environment for the engine process (SGLANG_ENABLE_SPEC_V2, ...).
    env: dict[str, str] = Field(default_factory=dict)
    # Optional fixed client concurrency; otherwise derived from the engine's effective cap.
    client_concurrency: int | None = None

    def flag(self, name: str, default: FlagValue | None = None) -> FlagValue | None:
        """Value of flag ``name`` (dashes or underscores), or ``default``."""
        return self.flags.get(name.replace("_", "-"), default)

    def with_flags(self, name: str, **changes: FlagValue | None) -> LaunchProfile:
        """A copy named ``name`` with flags changed (underscored keys; None removes a flag)."""
        flags = dict(self.flags)
        for key, value in changes.items():
            dashed = key.replace("_", "-")
            if value is None:
                flags.pop(dashed, None)
            else:
                flags[dashed] = value
        return self.model_copy(update={"name": name, "flags": flags})

    def output_flags(self) -> dict[str, str | None]:
        """The :data:`OUTPUT_FLAGS` of this profile (None: not set)."""
        return {k: None if self.flag(k) is None else str(self.flag(k)) for k in OUTPUT_FLAGS}

    def to_argv(self) -> list[str]:
        """Render the flags as argv: True -> ``--k``, False -> omitted, list -> ``--k a b``."""
        argv: list[str] = []
        for key, value in self.flags.items():
            opt = f"--{key}"
            if value is True:
                argv.append(opt)
            elif value is False:
                continue
            elif isinstance(value, list):
                argv += [opt, *(str(v) for v in value)]
            else:
                argv += [opt, str(value)]
        return argv


def load_profile(name_or_path: str) -> LaunchProfile:
    """Load a profile by name (``config/profiles/<name>.toml``) or by file path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = PROFILES_DIR / f"{name_or_path}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.toml")))
        raise ProfileError(f"launch profile {name_or_path!r} not found (known: {known})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: {exc}") from exc
    data.setdefault("name", path.stem)
    return LaunchProfile.model_validate(data)


def unmet_needs(needs: dict[str, str | None], have: dict[str, str | None]) -> list[str]:
    """``flag value`` for each output flag a job needs (set, not None) that an engine started
    with ``have`` lacks or sets otherwise (empty: the engine serves the job)."""
    return [f"{k} {v}" for k, v in sorted(needs.items()) if v is not None and have.get(k) != v]
