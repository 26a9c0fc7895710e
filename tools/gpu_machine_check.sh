#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on a lent GPU machine that has no network: build the
# payload here, run it there in one call, bring the results back (docs/sglang.md, "The GPU check").
#
#   tools/gpu_machine_check.sh build            # here: SGLang + kernels (the real-SGLang kit's
#                                               # recipe), the fleet's locked dependencies and
#                                               # Debian's redis-server, into .gpu/ (ignored)
#   tools/gpu_machine_check.sh run ARGS...      # there, in the device call that carries .gpu:
#                                               # unpack, then python -m bench.gpu_check ARGS
#                                               # --out $OUT/gpu-check (packed as one tarball)
#   tools/gpu_machine_check.sh fetch TARBALL    # here: unpack what came back into bench/results/
#
# REAL_SGLANG_KIT names the real-SGLang kit's folder (required for build); GPU_KIT the payload
# folder (default .gpu). A GPU node with network needs none of this: `make gpu-check`.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT_SRC=${REAL_SGLANG_KIT:-}
export GPU_KIT=${GPU_KIT:-.gpu}
# What the worker's node needs of requirements.lock: no test tools, no S3 client (the check's
# store is a local folder; workers/dataset/store.py imports boto3 only for s3:// URLs).
SKIP_DEFAULT="playwright moto ruff pytest pytest-timeout cfn-lint docker responses honcho flask
  flask-cors werkzeug aws-xray-sdk graphql-core joserfc jsonpath-ng jsonpatch jsonpointer
  jsonschema-path openapi-schema-validator openapi-spec-validator pathable py-partiql-parser
  antlr4-python3-runtime xmltodict lazy-object-proxy rfc3339-validator cryptography blinker
  itsdangerous greenlet boto3 botocore s3transfer jmespath"

case "${1:-}" in
  build)
    [ -n "$KIT_SRC" ] || { echo "set REAL_SGLANG_KIT to the real-SGLang kit's folder" >&2; exit 2; }
    bash "$KIT_SRC/setup.sh"
    SKIP=${SKIP:-$SKIP_DEFAULT} bash "$GPU_KIT/scripts/add_requirements.sh" requirements.lock
    bash "$GPU_KIT/scripts/add_redis.sh"
    du -sh "$GPU_KIT"/payload/* ;;
  run)
    shift
    out=${OUT:?run this inside the device call, where OUT is set}
    # shellcheck disable=SC1091
    source "$GPU_KIT/scripts/env.sh" > "$out/env.log" 2>&1 || { cat "$out/env.log"; exit 1; }
    export PYTHONPATH=$PYTHONPATH:$PWD
    rc=0
    # SIGINT before the call's limit: the check stops its workers and keeps what it measured.
    timeout -s INT "${GPU_CHECK_TIMEOUT_S:-560}" python3 -m bench.gpu_check --out /tmp/gpu-check \
      "$@" 2>&1 | tee "$out/gpu-check.log" || rc=$?
    tar -czf "$out/gpu-check.tar.gz" -C /tmp gpu-check
    exit $rc ;;
  fetch)
    tarball=${2:?the gpu-check.tar.gz that came back}
    tmp=$(mktemp -d)
    tar -xzf "$tarball" -C "$tmp"
    mkdir -p bench/results
    cp -r "$tmp"/gpu-check/. bench/results/
    rm -rf "$tmp"
    ls -la bench/results ;;
  *)
    sed -n '2,16p' "$0"; exit 2 ;;
esac
