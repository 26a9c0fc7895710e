"""The services of docker-compose.yml, one function each, and the environment they share.

:mod:`deploy.compose_gen` puts them together into the file (one GPU worker per GPU or group).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.node.gpu_group import GpuGroup

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GPUS = 7
DEFAULT_STAGGER_S = 30

IMAGES = {
    "redis": "redis:7.4",
    "minio": "quay.io/minio/minio:RELEASE.2025-09-07T16-13-09Z.hotfix.7aa24e772",
    "prometheus": "prom/prometheus:v3.5.0",
    "grafana": "grafana/grafana:12.1.1",
}
FLEET_IMAGE = "${FLEET_IMAGE:-gpu-fleet:latest}"
MODEL_CACHE_TARGET = "/root/.cache/huggingface"
# Kernel caches compiled at engine start (FlashInfer, Triton, TorchInductor, SGLang's own
# root, the CUDA driver's PTX cache) live on a volume, so a recreated container does not
# compile them again. FlashInfer appends .cache/flashinfer to its base.
JIT_CACHE = "/root/.cache/jit"
JIT_ENV = {"SGLANG_JIT_CACHE_ROOT": f"{JIT_CACHE}/sglang",
           "FLASHINFER_WORKSPACE_BASE": JIT_CACHE,
           "TRITON_CACHE_DIR": f"{JIT_CACHE}/triton",
           "TORCHINDUCTOR_CACHE_DIR": f"{JIT_CACHE}/torchinductor",
           "TORCH_EXTENSIONS_DIR": f"{JIT_CACHE}/torch_extensions",
           "CUDA_CACHE_PATH": f"{JIT_CACHE}/cuda"}
# Open files: an engine and its client hold thousands of sockets and files (SGLang's docs
# raise the limit before launching a server).
NOFILE = 1_048_576
# Container logs rotate (json-file: max-size per file, max-file files kept).
LOGGING = {"driver": "json-file",
           "options": {"max-size": "${LOG_MAX_SIZE:-100m}", "max-file": "${LOG_MAX_FILE:-5}"}}

# Exporter of gpuN: FLEET_METRICS_BASE_PORT + N (keep the default in containers: published).
METRICS_BASE_PORT = 9360
# How long `docker compose stop/down/up -d` lets a GPU worker hand its batches back.
GRACE = "${STOP_GRACE_PERIOD:-5m}"

# Set by this file per service, whatever .env says: a container's one GPU is CUDA device 0
# while its queue names the host GPU (FLEET_GPU would change the queue), and logs go to the
# ./logs bind mount.
GENERATED = ("FLEET_GPU", "FLEET_CUDA_DEVICE", "FLEET_LOG_DIR", "FLEET_ENGINE",
             "FLEET_METRICS_HOST")
# Given below with defaults of their own (the Redis and store parts of .env).
DERIVED = ("FLEET_REDIS_URL", "FLEET_REDIS_PASSWORD", "FLEET_STORE_URL",
           "FLEET_S3_ENDPOINT_URL", "FLEET_S3_REGION")

Env = dict[str, "str | None"]
Service = dict[str, Any]


def need(var: str) -> str:
    """Compose interpolation of a variable that .env must set."""
    return f"${{{var}:?set {var} in .env (see .env.example)}}"


def healthcheck(test: list[str], interval: str = "30s", start_period: str = "30s") -> Service:
    """A health check that probes every 10 s during its start period."""
    return {"test": test, "interval": interval, "timeout": "20s", "retries": 3,
            "start_period": start_period, "start_interval": "10s"}


def depends(**conditions: str) -> Service:
    """depends_on entries that are skipped where the service is not enabled (worker nodes)."""
    return {name: {"condition": cond, "required": False} for name, cond in conditions.items()}


def setting_names() -> list[str]:
    """Every FLEET_* variable config/settings.py reads, as .env would spell it."""
    from config.settings import S3Settings, Settings, SimSettings

    names = [f"FLEET_{f}".upper() for f in Settings.model_fields if f not in ("sim", "s3")]
    names += [f"FLEET_S3_{f}".upper() for f in S3Settings.model_fields]
    names += [f"FLEET_SIM_{f}".upper() for f in SimSettings.model_fields]
    return names


def settings_env() -> Env:
    """Every FLEET_* setting, from .env when set there (empty counts as unset)."""
    skip = set(GENERATED) | set(DERIVED)
    return {name: f"${{{name}:-}}" for name in setting_names() if name not in skip}


def redis_env() -> Env:
    """How the fleet reaches Redis: FLEET_REDIS_URL in .env wins (rediss://, a managed
    Redis), else the compose Redis. The password travels on its own and is quoted into the
    URL by config/settings.py, so '/', '#' or '?' in it are safe."""
    return {
        "FLEET_REDIS_URL": "${FLEET_REDIS_URL:-redis://${REDIS_HOST:-redis}:${REDIS_PORT:-6379}/0}",
        "FLEET_REDIS_PASSWORD": f"${{FLEET_REDIS_PASSWORD:-{need('REDIS_PASSWORD')}}}",
    }


def store_env() -> Env:
    """The store: its URL, endpoint (empty: AWS S3), region and credentials."""
    return {
        "FLEET_STORE_URL": "${FLEET_STORE_URL:-s3://${S3_BUCKET:-fleet}/${S3_PREFIX:-runs}}",
        # Empty means AWS S3. MinIO on this node is an explicit choice (S3_ENDPOINT_URL=
        # http://minio:9000, profile minio, FLEET_ALLOW_NODE_LOCAL_STORE=1): its data is lost
        # with the node (workers/dataset/location.py).
        "FLEET_S3_ENDPOINT_URL": "${FLEET_S3_ENDPOINT_URL:-${S3_ENDPOINT_URL:-}}",
        "FLEET_S3_REGION": "${FLEET_S3_REGION:-${AWS_DEFAULT_REGION:-us-east-1}}",
        "AWS_ACCESS_KEY_ID": need("AWS_ACCESS_KEY_ID"),
        "AWS_SECRET_ACCESS_KEY": need("AWS_SECRET_ACCESS_KEY"),
        "AWS_DEFAULT_REGION": "${AWS_DEFAULT_REGION:-us-east-1}",
        # A private CA for an https:// store endpoint (mount the file; see docs/security.md).
        "AWS_CA_BUNDLE": None,
    }


def fleet_env() -> Env:
    """Environment of the workers and the sink (None: passed through when set)."""
    return {**settings_env(), **redis_env(), **store_env(), "FLEET_LOG_DIR": "/app/logs"}


def fleet_base() -> Service:
    """What every service built from this repository's Dockerfile shares (``x-fleet``)."""
    return {
        "image": FLEET_IMAGE,
        # The base image by digest (SGLANG_IMAGE=<name>@sha256:...); the Dockerfile refuses a
        # bare tag unless ALLOW_UNPINNED_BASE=1.
        "build": {"context": ".", "dockerfile": "Dockerfile",
                  "args": {"SGLANG_IMAGE": "${SGLANG_IMAGE:-lmsysorg/sglang:v0.5.11}",
                           "ALLOW_UNPINNED_BASE": "${ALLOW_UNPINNED_BASE:-0}"}},
        "init": True,
        "hostname": need("NODE_NAME"),
        "environment": fleet_env(),
        "volumes": ["./logs:/app/logs"],
        "restart": "unless-stopped",
        "logging": LOGGING,
    }


def gpu_env() -> Env:
    """What a GPU worker adds to the fleet environment."""
    # The metrics exporter (port 9360 + N) answers Prometheus on the compose network and, on
    # METRICS_BIND, Prometheus on another node.
    return {"FLEET_ENGINE": "sglang", "FLEET_CUDA_DEVICE": "0", "HF_HUB_OFFLINE": "1",
            "FLEET_METRICS_HOST": "0.0.0.0", **JIT_ENV}


def gpu_base() -> Service:
    """What every GPU worker shares (``x-gpu-worker``)."""
    return {
        **fleet_base(),
        "environment": {**fleet_env(), **gpu_env()},
        "volumes": [{"type": "bind", "source": need("MODEL_CACHE"),
                     "target": MODEL_CACHE_TARGET, "read_only": True},
                    "./logs:/app/logs", f"jit-cache:{JIT_CACHE}"],
        "depends_on": depends(redis="service_healthy",
                              createbucket="service_completed_successfully"),
        "shm_size": "16gb",
        "ulimits": {"memlock": -1, "stack": 67108864,
                    "nofile": {"soft": NOFILE, "hard": NOFILE}},
        # On SIGTERM a worker stops consuming and hands its batches back (answered prompts
        # stored, the rest requeued), then stops its engine. A batch runs 5-15 min, so this is
        # not meant to let it finish: it covers the hand-back through a slow store (store
        # retries, ~2.5 min at worst) and the engine's stop (FLEET_ENGINE_STOP_GRACE_S + 5 s).
        # Past it, SIGKILL: the lease brings the batches back within ~35 s, prompts kept.
        "stop_grace_period": GRACE,
    }


def gpu_worker(gpu: int | GpuGroup, stagger_s: float, order: int | None = None) -> Service:
    """Worker ``gpuN`` (or ``gpuA-B``): owns its host GPUs (CUDA devices 0..k-1 in the
    container) and one engine on them; starts after ``order`` x ``stagger_s`` (default: N)."""
    group = gpu if isinstance(gpu, GpuGroup) else GpuGroup((gpu,))
    order = group.first if order is None else order
    celery = ["celery", "-A", "workers", "worker", "-Q", group.name, "-n", f"{group.name}@%h",
              "-l", "INFO"]
    port = METRICS_BASE_PORT + group.first
    own_env: Service = {}
    if group.size > 1:  # the container numbers its GPUs 0..k-1
        own_env["environment"] = {**gpu_base()["environment"],
                                  "FLEET_CUDA_DEVICE": ",".join(map(str, range(group.size)))}
    return {
        **gpu_base(), **own_env,
        "command": ["python", "-m", "deploy.supervise", "--delay", f"{order * stagger_s:g}",
                    "--", *celery],
        # Its exporter only (never the engine): 127.0.0.1 unless METRICS_BIND names the node's
        # private address, for a Prometheus on another node (docs/security.md).
        "ports": [f"${{METRICS_BIND:-127.0.0.1}}:{port}:{port}"],
        "deploy": {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "device_ids": [str(g) for g in group.gpus],
             "capabilities": ["gpu"]}]}}},
        # A model load takes minutes: failures count only after the start period (the
        # engine start timeout); the check passes as soon as the engine is healthy.
        "healthcheck": healthcheck(
            ["CMD", "python", "-m", "deploy.healthcheck", "heartbeat", f"{group.name}@%h"],
            start_period="30m"),
    }


def redis() -> Service:
    """The broker: persistent (AOF), never evicts, password from .env."""
    server = ("exec redis-server --port ${REDIS_PORT:-6379} --appendonly yes "
              "--appendfsync everysec --maxmemory-policy noeviction "
              "--maxmemory ${REDIS_MAXMEMORY:-8gb} "
              '--requirepass "$$REDIS_PASSWORD"')
    return {
        "image": IMAGES["redis"],
        "profiles": ["head"],
        "command": ["sh", "-c", server],
        "environment": {"REDIS_PASSWORD": need("REDIS_PASSWORD"),
                        "REDISCLI_AUTH": need("REDIS_PASSWORD")},
        "volumes": ["redis-data:/data"],
        "depends_on": CHECKED,
        # It listens on REDIS_PORT inside and out, so every node uses the same REDIS_PORT.
        "ports": ["${REDIS_BIND:-127.0.0.1}:${REDIS_PORT:-6379}:${REDIS_PORT:-6379}"],
        "healthcheck": healthcheck(
            ["CMD-SHELL", "redis-cli -p ${REDIS_PORT:-6379} ping | grep -q PONG"], "10s"),
        "restart": "unless-stopped",
        "stop_grace_period": "30s",
    }


def minio() -> Service:
    """The S3-compatible store (leave its profile out to use AWS S3 or another store)."""
    return {
        "image": IMAGES["minio"],
        "profiles": ["minio"],
        "command": ["server", "/data", "--console-address", ":9001"],
        "environment": {"MINIO_ROOT_USER": need("AWS_ACCESS_KEY_ID"),
                        "MINIO_ROOT_PASSWORD": need("AWS_SECRET_ACCESS_KEY")},
        "volumes": ["minio-data:/data"],
        "depends_on": CHECKED,
        "ports": ["${MINIO_BIND:-127.0.0.1}:9000:9000", "127.0.0.1:9001:9001"],
        "healthcheck": healthcheck(["CMD", "mc", "ready", "local"], "10s"),
        "restart": "unless-stopped",
    }


def preflight() -> Service:
    """One-shot: refuse placeholder secrets (deploy/preflight.py) before anything starts."""
    secrets = ("REDIS_PASSWORD", "FLOWER_PASSWORD", "GRAFANA_PASSWORD", "AWS_ACCESS_KEY_ID",
               "AWS_SECRET_ACCESS_KEY")
    return {**fleet_base(), "profiles": ["head"], "command": ["python", "-m", "deploy.preflight"],
            "environment": {name: need(name) for name in secrets}, "volumes": [],
            "restart": "no"}


# Services that must not start with a placeholder secret wait for the preflight job.
CHECKED = depends(preflight="service_completed_successfully")


def createbucket() -> Service:
    """One-shot: create the bucket of FLEET_STORE_URL if it is missing."""
    # The store only: no Redis URL or password.
    return {**fleet_base(), "profiles": ["head"],
            "command": ["python", "-m", "deploy.make_bucket"],
            "environment": {**settings_env(), **store_env()},
            "depends_on": depends(minio="service_healthy"), "restart": "no"}


def flower() -> Service:
    """Celery's web monitor with the shipped config, behind basic auth."""
    # Every interface of its container, so the port can be published (on FLOWER_BIND only:
    # /metrics and /healthcheck need no password).
    auth = f"${{FLOWER_USER:-admin}}:{need('FLOWER_PASSWORD')}"
    return {
        **fleet_base(), "profiles": ["head"],
        "command": ["celery", "-A", "workers", "flower", "--conf=deploy/flowerconfig.py",
                    "--address=0.0.0.0", "--port=5555"],
        # Redis only: Flower never touches the store, so it gets no AWS keys.
        "environment": {**settings_env(), **redis_env(), "FLOWER_BASIC_AUTH": auth},
        "ports": ["${FLOWER_BIND:-127.0.0.1}:5555:5555"],
        "depends_on": {**CHECKED, **depends(redis="service_healthy")},
        "healthcheck": healthcheck(["CMD", "python", "-m", "deploy.healthcheck", "http",
                                    "http://127.0.0.1:5555/healthcheck"]),
    }


def sink() -> Service:
    """The sink worker: aggregates finished jobs into Parquet shards (queue ``sink``)."""
    return {
        **fleet_base(), "profiles": ["head"],
        "command": ["celery", "-A", "workers", "worker", "-Q", "sink", "-n", "sink@%h",
                    "-l", "INFO"],
        "depends_on": depends(redis="service_healthy",
                              createbucket="service_completed_successfully"),
        "healthcheck": healthcheck(["CMD", "python", "-m", "deploy.healthcheck", "ping",
                                    "sink@%h"], "60s"),
        # Where `docker compose exec sink python -m producer ...` reads prompts and exports.
        "volumes": ["./logs:/app/logs", "./data:/app/data"],
        "ulimits": {"nofile": {"soft": NOFILE, "hard": NOFILE}},
        "stop_grace_period": "2m",
    }


def prometheus() -> Service:
    """Scrapes the workers' and Flower's metrics (config/prometheus.yml)."""
    return {
        "image": IMAGES["prometheus"],
        "profiles": ["head"],
        "command": ["--config.file=/etc/prometheus/prometheus.yml",
                    "--storage.tsdb.path=/prometheus", "--storage.tsdb.retention.time=30d"],
        "volumes": ["./config/prometheus.yml:/etc/prometheus/prometheus.yml:ro",
                    "prometheus-data:/prometheus"],
        "ports": ["${PROMETHEUS_BIND:-127.0.0.1}:9090:9090"],
        "healthcheck": healthcheck(
            ["CMD", "wget", "-q", "-O", "/dev/null", "http://127.0.0.1:9090/-/healthy"]),
        "restart": "unless-stopped",
    }


def grafana() -> Service:
    """Dashboards provisioned from config/grafana/ (admin password from .env)."""
    return {
        "image": IMAGES["grafana"],
        "profiles": ["head"],
        "environment": {"GF_SECURITY_ADMIN_USER": "${GRAFANA_USER:-admin}",
                        "GF_SECURITY_ADMIN_PASSWORD": need("GRAFANA_PASSWORD"),
                        "GF_USERS_ALLOW_SIGN_UP": "false"},
        "volumes": ["./config/grafana/provisioning:/etc/grafana/provisioning:ro",
                    "./config/grafana/dashboards:/etc/grafana/dashboards:ro",
                    "grafana-data:/var/lib/grafana"],
        "ports": ["${GRAFANA_BIND:-127.0.0.1}:3000:3000"],
        "depends_on": {**CHECKED, **depends(prometheus="service_healthy")},
        "healthcheck": healthcheck(
            ["CMD", "wget", "-q", "-O", "/dev/null", "http://127.0.0.1:3000/api/health"]),
        "restart": "unless-stopped",
    }


def model_download() -> Service:
    """One-shot (profile ``tools``): fill the model cache; the only writable mount of it."""
    return {
        **fleet_base(), "profiles": ["tools"],
        "command": ["python", "-m", "deploy.download_model"],
        "environment": {**settings_env(), "HF_TOKEN": None, "HF_HUB_OFFLINE": "0"},
        "volumes": [{"type": "bind", "source": need("MODEL_CACHE"),
                     "target": MODEL_CACHE_TARGET, "read_only": False}],
        "restart": "no",
    }
