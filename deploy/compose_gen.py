"""Write docker-compose.yml for a node with N GPUs (the committed file is the output for 7).

``python -m deploy.compose_gen --gpus 8`` (or ``make compose GPUS=8``) rewrites the file;
``--check`` exits 1 when the file on disk differs from what would be written. Engines wider
than one GPU: ``--gpus 8 --gpus-per-engine 2`` writes four workers ``gpu0-1`` ... ``gpu6-7``,
``--groups 0-3,4,5,6-7`` any layout (queue names as workers/gpu_group.py reads them).

Layout (docs/runbook.md explains each service):
- profile ``head``: ``redis`` (AOF, noeviction, password), ``createbucket`` (one-shot),
  ``flower`` (basic auth), ``sink``, ``prometheus``, ``grafana``; profile ``minio``: the
  S3-compatible store; profile ``tools``: ``model-download`` (one-shot). A worker-only node
  enables none of them.
- no profile: ``gpu0`` ... ``gpuN-1``. Service ``gpuN`` consumes queue ``gpuN`` (and the shared
  ``gpu``) as node ``gpuN@$NODE_NAME`` and reserves host GPU N only. Inside its container that
  GPU is CUDA device 0, so ``FLEET_CUDA_DEVICE=0`` pins the engine to it; the engine listens on
  127.0.0.1:3000N inside the container. Starts are staggered by N x ``--stagger-s``. A group
  service (``gpu0-1``) reserves each of its host GPUs, sees them as devices 0..k-1
  (``FLEET_CUDA_DEVICE=0,1``), runs one engine with ``--tp-size k`` on them and takes its
  ports from its first GPU; the i-th service starts after i x ``--stagger-s``.
- secrets and per-node values come from ``.env`` (see ``.env.example``), never from this file.

:func:`build` returns the resolved model (what Compose sees); :func:`render` writes the same
model with YAML anchors (``x-fleet``, ``x-gpu-worker``) so each GPU service is a few lines.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from workers.gpu_group import GpuGroup, GroupError, is_gpu_queue, parse_group

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
        "command": ["celery", "-A", "workers", "flower", "--conf=config/flowerconfig.py",
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


def engine_groups(gpus: int, per_engine: int = 1, groups: str | None = None) -> list[GpuGroup]:
    """The GPU groups of a node: ``groups`` (``0-1,2,3+4``) as given, else ``gpus`` GPUs cut
    into engines of ``per_engine``. Raises ValueError for overlaps, gaps past the node's GPUs
    or a count that does not divide."""
    if groups is not None:
        try:
            found = [parse_group(part.strip()) for part in groups.split(",")]
        except GroupError as exc:
            raise ValueError(str(exc)) from None
        used = [g for group in found for g in group.gpus]
        if len(used) != len(set(used)):
            raise ValueError(f"groups {groups} use a GPU twice")
        return found
    if gpus < 1 or per_engine < 1:
        raise ValueError("need at least one GPU")
    if gpus % per_engine:
        raise ValueError(f"{gpus} GPUs do not split into engines of {per_engine}")
    return [GpuGroup(tuple(range(i, i + per_engine))) for i in range(0, gpus, per_engine)]


def scrape_targets(groups: list[GpuGroup]) -> list[str]:
    """Prometheus targets of the workers (config/prometheus.yml lists those of 7 single GPUs)."""
    return [f"{g.service_name}:{METRICS_BASE_PORT + g.first}" for g in groups]


def build(gpus: int = DEFAULT_GPUS, stagger_s: float = DEFAULT_STAGGER_S,
          groups: list[GpuGroup] | None = None) -> Service:
    """The resolved compose model for ``gpus`` GPU workers, or one worker per group."""
    if groups is None:
        groups = engine_groups(gpus)
    if not groups:
        raise ValueError("need at least one GPU")
    singles = all(g.size == 1 for g in groups)
    services: Service = {
        "preflight": preflight(), "redis": redis(), "minio": minio(),
        "createbucket": createbucket(),
        "flower": flower(), "sink": sink(),
        **{g.service_name: gpu_worker(g, stagger_s, None if singles else i)
           for i, g in enumerate(groups)},
        "prometheus": prometheus(), "grafana": grafana(), "model-download": model_download(),
    }
    for service in services.values():
        service.setdefault("logging", LOGGING)
    volumes: Service = {name: {} for name in ("redis-data", "minio-data", "prometheus-data",
                                               "grafana-data", "jit-cache")}
    return {"name": "gpu-fleet", "services": services, "volumes": volumes}


# --- rendering with anchors -------------------------------------------------------------


class Flow(list):  # type: ignore[type-arg]
    """A short list written on one line (commands, profiles, health-check tests)."""


class _Dumper(yaml.SafeDumper):
    """Block-style YAML without generated anchors; None is written as an empty value."""

    def ignore_aliases(self, data: Any) -> bool:
        """Never emit PyYAML's own anchors (ours are written by hand)."""
        return True


_Dumper.add_representer(
    Flow, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))
_Dumper.add_representer(
    type(None), lambda d, _: d.represent_scalar("tag:yaml.org,2002:null", ""))

FLOW_KEYS = ("command", "profiles", "ports")


def _one_line_lists(service: Service) -> Service:
    """A copy of ``service`` whose short lists are written on one line."""
    out: Service = {k: Flow(v) if k in FLOW_KEYS else v for k, v in service.items()}
    if "healthcheck" in out:
        out["healthcheck"] = {**out["healthcheck"], "test": Flow(out["healthcheck"]["test"])}
    if "deploy" in out:
        devices = out["deploy"]["resources"]["reservations"]["devices"]
        for device in devices:
            device["device_ids"] = Flow(device["device_ids"])
            device["capabilities"] = Flow(device["capabilities"])
    return out


def _dump(data: Any, indent: int) -> str:
    """YAML of ``data``, every line indented by ``indent`` spaces."""
    text = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     width=1000)
    pad = " " * indent
    return "".join(pad + line.rstrip() + "\n" for line in text.splitlines())


def env_parts() -> dict[str, Env]:
    """The environment fragments written once as anchors (``x-<name>``) and merged."""
    return {"settings-env": settings_env(), "redis-env": redis_env(), "store-env": store_env()}


def _env_block(env: Env, base_env: Env | None, indent: int) -> str:
    """``environment:`` as a merge of the anchored fragments it holds plus its own keys, or
    '' when it is the base's."""
    if env == base_env:
        return ""
    parts = [name for name, part in env_parts().items()
             if all(k in env and env[k] == v for k, v in part.items())]
    covered = {k for name in parts for k in env_parts()[name]}
    own = {k: v for k, v in env.items() if k not in covered}
    pad = " " * indent
    merge = f"{pad}  <<: [{', '.join('*' + p for p in parts)}]\n" if parts else ""
    return f"{pad}environment:\n" + merge + (_dump(own, indent + 2) if own else "")


def _service_block(service: Service, base: Service | None, anchor: str | None,
                   indent: int) -> str:
    """One service: ``<<: *anchor`` and the keys that differ from that base."""
    if base is None or anchor is None:
        return _dump(_one_line_lists(service), indent)
    rest = {k: v for k, v in service.items() if k != "environment" and base.get(k) != v}
    text = f"{' ' * indent}<<: *{anchor}\n"
    base_env: Env = base["environment"]
    text += _env_block(service.get("environment", base_env), base_env, indent)
    return text + (_dump(_one_line_lists(rest), indent) if rest else "")


HEADER = """\
# Generated by deploy/compose_gen.py for {gpus} GPUs (starts staggered by {stagger:g} s).
# Do not edit: change the generator, or run `make compose GPUS=N`.
# Values and secrets come from .env (copy .env.example); docs/runbook.md explains it all.
# Service gpuN: queue gpuN, node gpuN@$NODE_NAME, host GPU N only (CUDA device 0 inside its
# container, hence FLEET_CUDA_DEVICE=0), engine on 127.0.0.1:3000N inside the container.
# Every FLEET_* setting reaches every fleet container from .env (${{FLEET_X:-}}: empty is unset);
# a variable without a value is passed through from .env when set there.
"""
GROUP_HEADER = """\
# GPU groups: {layout}.
# Service gpuA-B reserves host GPUs A..B (CUDA devices 0..k-1 inside its container, hence
# FLEET_CUDA_DEVICE=0,1,...) and runs one engine with --tp-size k on them; its engine and
# exporter ports are those of GPU A. Targets for config/prometheus.yml:
#   {targets}
"""


def render(gpus: int = DEFAULT_GPUS, stagger_s: float = DEFAULT_STAGGER_S,
           groups: list[GpuGroup] | None = None) -> str:
    """The text of docker-compose.yml (the model of :func:`build`, with anchors)."""
    model = build(gpus, stagger_s, groups)
    if groups is not None and any(g.size > 1 for g in groups):
        layout = ", ".join(g.name for g in groups)
        gpus = sum(g.size for g in groups)
        header = HEADER.format(gpus=gpus, stagger=stagger_s) + GROUP_HEADER.format(
            layout=layout, targets=", ".join(scrape_targets(groups)))
    else:
        header = HEADER.format(gpus=gpus, stagger=stagger_s)
    fleet, gpu = fleet_base(), gpu_base()
    fleet_rest = {k: v for k, v in fleet.items() if k != "environment"}
    gpu_rest = {k: v for k, v in gpu.items() if k != "environment" and fleet.get(k) != v}
    parts = [
        header,
        "name: gpu-fleet\n\n",
        *(f"x-{name}: &{name}\n" + _dump(part, 2) + "\n" for name, part in env_parts().items()),
        "x-fleet: &fleet\n", _dump(fleet_rest, 2), _env_block(fleet_env(), None, 2), "\n",
        "x-gpu-worker: &gpu-worker\n  <<: *fleet\n",
        _env_block(gpu["environment"], fleet_env(), 2), _dump(gpu_rest, 2), "\n",
        "services:\n",
    ]
    for name, service in model["services"].items():
        if is_gpu_queue(name):
            base, anchor = gpu, "gpu-worker"
        elif service.get("image") == FLEET_IMAGE:
            base, anchor = fleet, "fleet"
        else:
            base, anchor = None, None
        parts += [f"  {name}:\n", _service_block(service, base, anchor, 4), "\n"]
    parts += ["volumes:\n", _dump(model["volumes"], 2)]
    return "".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: write (or --check) the compose file."""
    p = argparse.ArgumentParser(prog="python -m deploy.compose_gen",
                                description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=DEFAULT_GPUS)
    p.add_argument("--gpus-per-engine", type=int, default=1,
                   help="GPUs of one tensor-parallel engine (one worker per group)")
    p.add_argument("--groups", default=None,
                   help="explicit GPU groups, e.g. 0-1,2-3,4,5 (overrides --gpus)")
    p.add_argument("--stagger-s", type=float, default=DEFAULT_STAGGER_S,
                   help="seconds between two GPU workers' starts")
    p.add_argument("--out", type=Path, default=ROOT / "docker-compose.yml")
    p.add_argument("--check", action="store_true", help="exit 1 if --out is not up to date")
    ns = p.parse_args(argv)
    try:
        groups = engine_groups(ns.gpus, ns.gpus_per_engine, ns.groups)
    except ValueError as exc:
        p.error(str(exc))
    text = render(ns.gpus, ns.stagger_s, groups)
    if ns.check:
        current = ns.out.read_text() if ns.out.exists() else ""
        if current != text:
            print(f"{ns.out} differs from what deploy/compose_gen.py writes", file=sys.stderr)
            return 1
        return 0
    ns.out.write_text(text)
    print(f"wrote {ns.out} ({len(groups)} GPU workers: {', '.join(g.name for g in groups)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
