"""Refuse to start with a placeholder secret (``change-me`` from .env.example).

``python -m deploy.preflight`` checks every secret of ``.env`` the head node's services use
(Redis, Flower, Grafana, the store/MinIO); ``python -m deploy.preflight redis`` only Redis'.
The compose one-shot ``preflight`` runs it before Redis, MinIO, Flower and Grafana start
(they depend on it), and the Procfile runs it before its Redis. One line per problem on
stderr, naming the variable and never its value; exit 1 if there is any.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from config.settings import is_placeholder

SECRETS = {
    "redis": ("REDIS_PASSWORD",),
    "flower": ("FLOWER_PASSWORD",),
    "grafana": ("GRAFANA_PASSWORD",),
    "store": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),  # MinIO's root user too
}


def problems(env: Mapping[str, str], groups: Sequence[str]) -> list[str]:
    """One line per secret of ``groups`` that is missing or a placeholder in ``env``."""
    out = []
    for group in groups:
        for name in SECRETS[group]:
            value = env.get(name)
            if not value:
                out.append(f"{name} is not set: set it in .env (see .env.example)")
            elif is_placeholder(value):
                out.append(f"{name} is still the placeholder from .env.example: set a real "
                           "secret in .env (openssl rand -hex 24)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: check the named groups (default: all); exit 1 on any problem."""
    groups = list(argv if argv is not None else sys.argv[1:]) or list(SECRETS)
    unknown = [g for g in groups if g not in SECRETS]
    if unknown:
        print(f"usage: python -m deploy.preflight [{'|'.join(SECRETS)}]...", file=sys.stderr)
        return 2
    found = problems(os.environ, groups)
    for line in found:
        print(f"refused: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
