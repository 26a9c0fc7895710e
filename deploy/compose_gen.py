"""Write docker-compose.yml for a node with N GPUs (the committed file is the output for 7).

``python -m deploy.compose_gen --gpus 8`` (or ``make compose GPUS=8``) rewrites the file;
``--check`` exits 1 when the file on disk differs from what would be written. Engines wider
than one GPU: ``--gpus 8 --gpus-per-engine 2`` writes four workers ``gpu0-1`` ... ``gpu6-7``,
``--groups 0-3,4,5,6-7`` any layout (queue names as workers/node/gpu_group.py reads them).

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

from deploy.compose_services import (  # noqa: F401  (GENERATED, JIT_ENV, setting_names: tests)
    DEFAULT_GPUS,
    DEFAULT_STAGGER_S,
    FLEET_IMAGE,
    GENERATED,
    JIT_ENV,
    LOGGING,
    METRICS_BASE_PORT,
    ROOT,
    Env,
    Service,
    createbucket,
    fleet_base,
    fleet_env,
    flower,
    gpu_base,
    gpu_worker,
    grafana,
    minio,
    model_download,
    preflight,
    prometheus,
    redis,
    redis_env,
    setting_names,
    settings_env,
    sink,
    store_env,
)
from workers.node.gpu_group import GpuGroup, GroupError, is_gpu_queue, parse_group


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
