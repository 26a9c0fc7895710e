#!/usr/bin/env bash
# bench/gpu_configs.py on the lent GPU machine (no network there), in one device call that
# carries a kit folder (GPU_KIT: .gpu for SGLang 0.5.11 from the real-SGLang kit, or one that
# tools/sglang_site.sh made for another release, e.g. .gpu17).
#
#   GPU_KIT=.gpu17 RSG_WORK=/tmp/rsg17 tools/gpu_configs_machine.sh NAME...
#
# It stops what a cut-off earlier call left on the GPU (by pid), sources the kit's env.sh
# (unpack, patch, exports), then gives every config.json folder of tests/fixtures/models/ the
# kit's small tokenizer (qwen3-tiny's) under /tmp/m/<folder> (--load-format dummy: no weights
# travel), unpacks payload/extra.tar.xz into the site when the kit has one, and runs
# `python -m bench.gpu_configs --only NAME...`. What comes back: $OUT/configs.tar.gz (one folder
# per configuration: server.log, argv.txt, summary.json, the HTTP answers) and $OUT/run.log.
set -uo pipefail
cd "${FLEET_ROOT:-$(dirname "$0")/..}"
out=${OUT:?run this inside the device call, where OUT is set}
for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p"; done
export GPU_KIT=${GPU_KIT:-.gpu}
# shellcheck disable=SC1091
source "$GPU_KIT/scripts/env.sh" > "$out/env.log" 2>&1 || { tail -20 "$out/env.log"; exit 1; }
W=${RSG_WORK:-/tmp/rsg}
if [ -f "$GPU_KIT/payload/extra.tar.xz" ]; then
  tar -xJf "$GPU_KIT/payload/extra.tar.xz" -C "$W/site"
fi
export PYTHONPATH=$PYTHONPATH:$PWD
python3 -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
tok=$RSG_MODELS/qwen3-tiny
for cfg in tests/fixtures/models/*/config.json; do
  d=/tmp/m/$(basename "$(dirname "$cfg")")
  mkdir -p "$d" && cp "$cfg" "$d/" && cp "$tok"/tokenizer*.json "$d/"
done
timeout -s INT "${CONFIGS_TIMEOUT_S:-500}" python3 -m bench.gpu_configs \
  --configs "${CONFIGS:-bench/gpu_configs.json}" --out /tmp/configs \
  --budget-s "${BUDGET_S:-420}" --only "$@"
rc=$?
tar -czf "$out/configs.tar.gz" -C /tmp configs
exit $rc
