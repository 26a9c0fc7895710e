#!/bin/sh
# Refuse to build on a base image named by tag only (two nodes could pull different images).
# Usage: check_pinned.sh IMAGE [ALLOW_UNPINNED]   (run by the Dockerfile before anything else)
# IMAGE must end in @sha256:<64 hex digits>. With ALLOW_UNPINNED=1 a tag passes, with a warning.
image="$1"
allow="${2:-0}"
digest="${image##*@sha256:}"
if [ "$digest" != "$image" ] && [ "${#digest}" -eq 64 ] \
    && [ -z "$(printf '%s' "$digest" | tr -d '0-9a-f')" ]; then
    echo "base image pinned by digest: $image"
    exit 0
fi
if [ "$allow" = "1" ]; then
    {
        echo "################################################################################"
        echo "WARNING: base image $image is NOT pinned by digest (ALLOW_UNPINNED_BASE=1)."
        echo "WARNING: two nodes building now and later may get different images."
        echo "WARNING: set SGLANG_IMAGE=<name>@sha256:<digest> in .env (README, runbook)."
        echo "################################################################################"
    } >&2
    exit 0
fi
echo "error: base image $image is not pinned by digest. Run" >&2
echo "  docker pull $image && docker inspect --format '{{index .RepoDigests 0}}' $image" >&2
echo "and set SGLANG_IMAGE=<that name@sha256:...> in .env (or ALLOW_UNPINNED_BASE=1 to" >&2
echo "build anyway, with a warning)." >&2
exit 1
