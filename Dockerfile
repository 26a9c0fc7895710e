# The fleet image: SGLang's own image (CUDA, PyTorch, SGLang, huggingface_hub) plus this
# repository. Every fleet service in docker-compose.yml runs it: the GPU workers (which start
# `python -m sglang.launch_server` as their engine), the sink, Flower and the one-shot jobs.
#
# The base image is pinned by digest so every node builds the same image: SGLANG_IMAGE must be
# <name>@sha256:<digest> (docker compose passes SGLANG_IMAGE from .env). The default below is
# the tag the fleet is tested with; the digest cannot be known here, so a build on the bare
# tag stops at deploy/check_pinned.sh with the two commands that find it, unless
# ALLOW_UNPINNED_BASE=1 (then it warns loudly). See docs/runbook.md, step 1.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.11
FROM ${SGLANG_IMAGE}
ARG SGLANG_IMAGE
ARG ALLOW_UNPINNED_BASE=0

COPY deploy/check_pinned.sh /tmp/check_pinned.sh
RUN sh /tmp/check_pinned.sh "$SGLANG_IMAGE" "$ALLOW_UNPINNED_BASE"

WORKDIR /app
# /app on the path so `celery -A workers` and `python -m deploy.*` import the fleet; the model
# cache is mounted read-only at HF_HOME and never downloaded from at run time.
ENV PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    HF_HOME=/root/.cache/huggingface \
    HF_HUB_OFFLINE=1

# The fleet needs Python >= 3.11 (tomllib; the image has 3.12): fail the build, not the run.
RUN python -c "import sys; assert sys.version_info >= (3, 11), sys.version"

# Dependencies first (a layer that changes only with pyproject.toml and the lock), then the
# code. requirements.lock pins every package pip installs here (-c: the SGLang image's own
# packages that already satisfy the fleet are left as they are), so two builds match.
COPY pyproject.toml README.md requirements.lock ./
RUN mkdir -p producer workers config \
    && touch producer/__init__.py workers/__init__.py config/__init__.py \
    && python -m pip install --no-cache-dir -c requirements.lock -e . \
    && rm -rf producer workers config

COPY . .

# The compose file names each service's command; no entrypoint of the base image in between.
ENTRYPOINT []
CMD ["celery", "-A", "workers", "worker", "-Q", "gpu0", "-n", "gpu0@%h", "-l", "INFO"]
