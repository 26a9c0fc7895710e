#!/usr/bin/env bash
# The venv of SpecForge and vLLM speculators (tools/trainers.lock) that
# tests/test_export_loaders.py runs their own data code in. Built once per lock file and kept
# across runs under ~/.cache (the lock's hash names it); prints its path.
#
#   bash tools/trainers_venv.sh        # -> ~/.cache/gpu-batch-fleet/trainers-<hash>
set -euo pipefail
cd "$(dirname "$0")/.."
lock=tools/trainers.lock
venv="${FLEET_TRAINERS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-batch-fleet/trainers-$(sha256sum "$lock" | cut -c1-12)}"
if [ ! -f "$venv/.installed" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  # Pinned, every dependency listed: no resolver run (SpecForge's own pins name a CUDA torch
  # and sglang, which its data path needs neither of).
  "$venv/bin/python" -m pip install -q --no-deps -r "$lock" >&2
  "$venv/bin/python" -c "import specforge.data.prompt_builder, speculators.cli.prepare_data" >&2
  touch "$venv/.installed"
fi
echo "$venv"
