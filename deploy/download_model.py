"""Download the models a launch profile names into the Hugging Face cache (once per node).

The GPU workers mount that cache read-only and run with ``HF_HUB_OFFLINE=1``, so the model
must be there before they start: ``docker compose run --rm model-download`` (or
``python -m deploy.download_model --profile qwen36-27b`` on a host with ``huggingface_hub``).
``HF_TOKEN`` is read from the environment for gated models.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from config.launch_profile import LaunchProfile, ProfileError, load_profile
from config.settings import load_settings

# Profile flags that name a model (a hub repository id or a local folder).
MODEL_FLAGS = ("model-path", "tokenizer-path", "speculative-draft-model-path")


def models_of(profile: LaunchProfile) -> list[str]:
    """Hub repository ids the profile needs (local folders are skipped)."""
    found: list[str] = []
    for flag in MODEL_FLAGS:
        value = profile.flag(flag)
        if isinstance(value, str) and value not in found and not Path(value).is_absolute():
            found.append(value)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: download every model of the profile; 0 on success."""
    p = argparse.ArgumentParser(prog="python -m deploy.download_model",
                                description=__doc__.splitlines()[0])
    p.add_argument("--profile", help="launch profile name or TOML path (default: FLEET_PROFILE)")
    p.add_argument("--dry-run", action="store_true", help="print the model ids only")
    ns = p.parse_args(argv)
    try:
        models = models_of(load_profile(ns.profile or load_settings().profile))
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for repo in models:
        print(f"model {repo}", flush=True)
        if not ns.dry_run:
            from huggingface_hub import snapshot_download

            print(f"  -> {snapshot_download(repo)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
