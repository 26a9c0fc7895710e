#!/usr/bin/env bash
# A newer SGLang for the lent GPU machine (no network there): its wheels and the Python packages
# its server path imports that the machine lacks, for CPython 3.12 on x86-64, unpacked into one
# site folder and packed as payload/site.tar.xz of a separate kit folder. Runs here, with pip and
# network; nothing is installed into this machine's Python.
#
#   tools/sglang_site.sh 0.5.23 .gpu23        # kit folder; its cache is .gpu23-cache
#   tools/sglang_site.sh 0.5.17 .gpu17        # the newest release on the machine's torch 2.11
#
# The kit folder gets payload/site.tar.xz (this release) and, copied from BASE_KIT (default
# .gpu, the folder `tools/gpu_machine_check.sh build` makes), the rest a GPU check needs there:
# scripts/ (unpack, environment), models/ (config + tokenizer folders), payload/project-site.tar.xz
# and payload/redis.tar.xz. On the GPU machine: `GPU_KIT=.gpu23 tools/gpu_machine_check.sh run ...`.
#
# What the GPU machine has (docs: its image): Python 3.12.3, torch 2.11.0+cu130, triton 3.6.0,
# transformers 5.17.0, tokenizers 0.23.2, numpy, pillow, einops, uvloop, pyyaml, regex, psutil,
# requests, safetensors, sentencepiece, huggingface-hub, jinja2, aiohttp, httpx, anyio.
# Which of SGLang's modules its server imports at module level (and so which packages must be
# there) was read from the release's own source: every unguarded module-level import reachable
# from sglang.launch_server, the HTTP server, engine, scheduler, tokenizer and detokenizer
# managers, model runner, the Qwen3.5 model and its MTP draft, and bench_offline_throughput.
#
# Left out on purpose, as for 0.5.11: sgl_kernel's FA3 (flash_ops.abi3.so, 1.1 GB), FlashMLA,
# its SM100 build and its cp310-only infllm module (Hopper loads sm90/); flashinfer's JIT sources
# (it is carried for import only; the profiles use triton attention and pytorch sampling);
# SGLang's Rust gRPC, bench and server extensions (used only with --grpc-port, SGLANG_RUST_SERVER
# or the Rust bench), and its diffusion package (multimodal_gen).
#
# Pins: those SGLang's wheel metadata names (== pins) where the machine does not already have
# that version; otherwise the versions the 0.5.11 payload carried. torch stays the machine's
# 2.11.0: SGLang 0.5.23 and sglang-kernel 0.4.10 ask for torch==2.14.1, which is ~1 GB of CUDA
# wheels and cannot travel in a 64 MiB call (docs/sglang_releases.md says what follows).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?SGLang version, e.g. 0.5.23}
KIT=${2:?kit folder, e.g. .gpu23}
BASE_KIT=${BASE_KIT:-.gpu}
CACHE=${KIT}-cache
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

case "$VERSION" in
  0.5.23)
    KERNEL=0.4.10
    PKGS="transformers==5.19.0 xgrammar==0.2.7 apache-tvm-ffi==0.1.11 flashinfer-python==0.7.2
          openai==2.8.0 compressed-tensors==0.18.0
          fastapi==0.128.0 starlette==0.50.0 pydantic==2.14.4 pydantic-core==2.50.5
          annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
          uvicorn==0.54.0 python-multipart==0.0.34 partial-json-parser==0.2.1.1.post7
          distro==1.9.0 sniffio==1.3.1 jiter==0.19.0 ipython==9.18.1 traitlets==5.16.1
          dill==0.4.1 loguru==0.7.3 gguf==0.19.0 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
          jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
          rpds-py==2026.9.1 msgspec==0.23.0 setproctitle==1.3.8 orjson==3.13.0
          pybase64==1.5.1 pyzmq==27.3.0" ;;
  0.5.17)
    # Its METADATA pins: transformers 5.12.1, xgrammar 0.2.1, apache-tvm-ffi 0.1.11,
    # flashinfer-python 0.6.15.post1, openai 2.6.1; torch 2.11.0 is the machine's own.
    # transformers 5.12.1 refuses the machine's tokenizers 0.23.2 (<= 0.23.0), and the MTP
    # worker imports layers/attention/dsa_backend.py, which imports deep_gemm unguarded
    # (run with SGLANG_ENABLE_JIT_DEEPGEMM=0). On 2026-12-02 these two travelled as a separate
    # payload/extra.tar.xz that tools/gpu_configs_machine.sh unpacks into the site.
    KERNEL=0.4.5
    PKGS="transformers==5.12.1 tokenizers==0.22.2 sgl-deep-gemm==0.1.5.post1
          xgrammar==0.2.1 apache-tvm-ffi==0.1.11
          flashinfer-python==0.6.15.post1 openai==2.6.1 compressed-tensors==0.18.0
          fastapi==0.128.0 starlette==0.50.0 pydantic==2.14.4 pydantic-core==2.50.5
          annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
          uvicorn==0.54.0 python-multipart==0.0.34 partial-json-parser==0.2.1.1.post7
          distro==1.9.0 sniffio==1.3.1 jiter==0.19.0 ipython==9.18.1 traitlets==5.16.1
          dill==0.4.1 loguru==0.7.3 gguf==0.19.0 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
          jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
          rpds-py==2026.9.1 msgspec==0.23.0 setproctitle==1.3.8 orjson==3.13.0
          pybase64==1.5.1 pyzmq==27.3.0" ;;
  *) echo "no package list for sglang $VERSION here" >&2; exit 2 ;;
esac
PLAT="--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"

wheel() {  # wheel NAME VERSION: the cached wheel's path, or nothing
  local n
  n=$(echo "$1" | tr 'A-Z-.' 'a-z__')
  find "$CACHE/whl" -maxdepth 1 -iname "${n}-${2}-*.whl" | head -1
}

mkdir -p "$CACHE/whl" "$KIT/payload"
need=()
for p in "sglang==$VERSION" "sglang-kernel==$KERNEL" $PKGS; do
  n=${p%%==*}; v=${p##*==}
  [ -n "$(wheel "$n" "$v")" ] && continue
  # The 0.5.11 payload's cache already holds most of them.
  f=$(BASE_CACHE=${BASE_KIT}-cache; find "$BASE_CACHE/whl" -maxdepth 1 \
      -iname "$(echo "$n" | tr 'A-Z-.' 'a-z__')-${v}-*.whl" 2>/dev/null | head -1)
  if [ -n "$f" ]; then cp "$f" "$CACHE/whl/"; else need+=("$p"); fi
done
if [ ${#need[@]} -gt 0 ]; then
  echo "downloading ${#need[@]} wheel(s): ${need[*]}"
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLAT -d "$CACHE/whl" "${need[@]}"
fi

SITE=$CACHE/site
rm -rf "$SITE" && mkdir -p "$SITE"
whls=()
for p in $PKGS; do
  f=$(wheel "${p%%==*}" "${p##*==}")
  [ -n "$f" ] || { echo "missing wheel for $p" >&2; exit 1; }
  whls+=("$f")
done
# shellcheck disable=SC2086
python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
  --implementation cp $PLAT --target "$SITE" "${whls[@]}"
unzip -q -o "$(wheel sglang "$VERSION")" -d "$SITE" -x 'sglang/multimodal_gen/*' \
  'sglang/srt/rust_extensions/_grpc*' 'sglang/srt/rust_extensions/_bench*' \
  'sglang/srt/rust_extensions/_server*'
# The dist-info stays: the launcher checks sglang-kernel's version by its metadata.
unzip -q -o "$(wheel sglang-kernel "$KERNEL")" 'sgl_kernel/*' "sglang_kernel-$KERNEL.dist-info/*" \
  -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/flashmla_ops.abi3.so' 'sgl_kernel/sm100/*' \
  'sgl_kernel/infllm_ops.*' -d "$SITE"
rm -rf "$SITE/xgrammar/lib/libxgrammar.a" "$SITE/flashinfer/data" "$SITE/bin" "$SITE/share"
find "$SITE" -path '*.dist-info/direct_url.json' -delete
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
tar -C "$SITE" -cf - . | xz -T0 -6 > "$KIT/payload/site.tar.xz.part"
mv "$KIT/payload/site.tar.xz.part" "$KIT/payload/site.tar.xz"

# The rest of a kit, from the base kit.
rm -rf "$KIT/scripts" "$KIT/models"
cp -r "$BASE_KIT/scripts" "$BASE_KIT/models" "$KIT/"
for f in project-site.tar.xz redis.tar.xz; do
  [ -f "$BASE_KIT/payload/$f" ] && cp "$BASE_KIT/payload/$f" "$KIT/payload/"
done
# The base kit's JIT prewarm lists 0.5.11's sglang.jit_kernel modules; 0.5.23 has its JIT kernels
# under sglang.kernels.jit, so the prewarm is replaced by a no-op (the server compiles what it
# needs itself).
printf '#!/usr/bin/env python3\n"""Skipped: the base kit lists 0.5.11 JIT modules."""\nprint("prewarm skipped (sglang %s)")\n' \
  "$VERSION" > "$KIT/scripts/prewarm_jit.py"
echo "sglang $VERSION, sglang-kernel $KERNEL" > "$KIT/payload/RELEASE"
du -sh "$KIT"/payload/* "$KIT/models"
du -sh "$KIT"
