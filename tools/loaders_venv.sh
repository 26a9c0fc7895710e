#!/usr/bin/env bash
# A venv of its own with SpecForge and vLLM speculators from the package registry, for
# tests/test_export_loaders.py (which loads the exports with their own data code).
#
#   bash tools/loaders_venv.sh            # -> /tmp/loaders-venv (LOADERS_VENV moves it)
#
# Both depend on torch (and SpecForge on much of SGLang's stack): several GB of wheels, so this
# is not part of `make test`; the test skips, saying why, when the venv is not there.
set -euo pipefail
VENV="${LOADERS_VENV:-/tmp/loaders-venv}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q specforge speculators datasets
"$VENV/bin/python" -c "import specforge.data.parse, speculators; print('loaders ready in $VENV')"
