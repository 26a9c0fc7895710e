"""Deployment: the compose file against the Compose Specification, the Procfile under honcho,
the supervisor and health checks, and two nodes sharing one Redis.

No Docker engine runs here, so the compose file is checked as data: against the Compose
Specification JSON schema (``tests/fixtures/compose-spec.json``, vendored from
compose-spec/compose-spec), raw and after interpolating ``.env.example`` the way Compose does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
import redis
import yaml

from deploy import compose_gen, healthcheck, procfile_gen
from producer.localfleet import free_port, free_port_block, start_worker, stop_process
from tests.conftest import ROOT, run_producer, wait_done, write_prompts
from workers.node import heartbeat
from workers.redisdb.keys import NodeKeys

COMPOSE = ROOT / "docker-compose.yml"
SCHEMA = ROOT / "tests" / "fixtures" / "compose-spec.json"
ENV_EXAMPLE = ROOT / ".env.example"
ONE_SHOT = {"preflight", "createbucket", "model-download"}
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH|_KEY$|REDIS_URL", re.IGNORECASE)
GPU_SERVICE = re.compile(r"^gpu(\d+)$")
PY = str(Path(sys.executable).parent)


# --- Compose interpolation (the subset the file uses: $$, ${V}, ${V:-d}, ${V-d}, ${V:?e}) ------

_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])((?:[^{}]|\{[^{}]*\})*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Resolve variables in every string of ``value`` as Compose does before it runs."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.groups()
        val = env.get(name)
        if op in (":?", "?") and not val:
            raise KeyError(f"{name} must be set: {arg}")
        if op == ":-" and not val or op == "-" and val is None:
            return str(interpolate(arg, env))
        return val or ""

    return _VAR.sub(sub, value)


def env_example() -> dict[str, str]:
    """KEY=value lines of .env.example."""
    pairs = (line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
             if line and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def load_compose(text: str) -> dict[str, Any]:
    """The compose model Compose would see (merge keys resolved, x- fragments dropped)."""
    model = yaml.safe_load(text)
    return {k: v for k, v in model.items() if not k.startswith("x-")}


def env_of(service: dict[str, Any]) -> dict[str, str | None]:
    """A service's environment as a mapping (list form ``K=V`` / ``K`` or mapping form)."""
    env = service.get("environment", {})
    if isinstance(env, dict):
        return env
    return {k: v for k, _, v in (item.partition("=") for item in env)}


def gpu_services(model: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """GPU index -> service, for services named gpuN."""
    return {int(m.group(1)): svc for name, svc in model["services"].items()
            if (m := GPU_SERVICE.match(name))}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The committed docker-compose.yml."""
    return load_compose(COMPOSE.read_text())


# --- the compose file ------------------------------------------------------------------------


def test_committed_files_are_the_generators_output_for_seven_gpus():
    assert COMPOSE.read_text() == compose_gen.render(7)
    assert (ROOT / "Procfile").read_text() == procfile_gen.render(7)
    for gpus in (1, 7, 8):  # the anchored text means exactly the resolved model
        assert load_compose(compose_gen.render(gpus)) == compose_gen.build(gpus)


@pytest.mark.parametrize("interpolated", [False, True], ids=["raw", "with-env-example"])
def test_compose_file_follows_the_compose_specification(compose, interpolated):
    schema = json.loads(SCHEMA.read_text())
    model = interpolate(compose, env_example()) if interpolated else compose
    jsonschema.validate(model, schema, cls=jsonschema.Draft7Validator)
    for gpus in (1, 8):
        jsonschema.validate(compose_gen.build(gpus), schema, cls=jsonschema.Draft7Validator)


def settings_in(svc_env: dict[str, str | None], monkeypatch: pytest.MonkeyPatch):
    """config.settings.Settings as a container with environment ``svc_env`` reads it."""
    from config.settings import Settings

    for key in list(os.environ):
        if key.startswith(("FLEET_", "REDIS_", "AWS_")):
            monkeypatch.delenv(key)
    for key, value in svc_env.items():
        if value is not None:
            monkeypatch.setenv(key, value)
    return Settings()


def test_compose_needs_every_required_variable_from_env(compose, monkeypatch):
    env = {**env_example(), "REDIS_PASSWORD": "p/w#x?y@z"}
    with pytest.raises(KeyError, match="REDIS_PASSWORD"):
        interpolate(compose, {k: v for k, v in env.items() if k != "REDIS_PASSWORD"})
    settings = settings_in(env_of(interpolate(compose, env)["services"]["gpu3"]), monkeypatch)
    url = settings.redis_url.get_secret_value()
    assert url == "redis://:p%2Fw%23x%3Fy%40z@redis:6379/0"
    assert redis.Redis.from_url(url).connection_pool.connection_kwargs["password"] == "p/w#x?y@z"
    managed = "rediss://:pw@redis.example:6379/0?ssl_cert_reqs=required"
    url = env_of(interpolate(compose, {**env, "FLEET_REDIS_URL": managed})["services"]["sink"])
    assert url["FLEET_REDIS_URL"] == managed


@pytest.mark.parametrize("gpus", [7, 8, 2])
def test_every_gpu_service_reserves_exactly_its_gpu(gpus):
    model = load_compose(compose_gen.render(gpus))
    workers = gpu_services(model)
    assert sorted(workers) == list(range(gpus))
    for gpu, svc in workers.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [str(gpu)],
                            "capabilities": ["gpu"]}]
        cmd = svc["command"]
        assert cmd[cmd.index("-Q") + 1] == f"gpu{gpu}"
        assert cmd[cmd.index("-n") + 1] == f"gpu{gpu}@%h"
        env = env_of(svc)
        # The container sees its one GPU as CUDA device 0; the queue keeps the host index.
        assert env["FLEET_CUDA_DEVICE"] == "0" and "FLEET_GPU" not in env
        assert env["FLEET_ENGINE"] == "sglang"
        assert env["FLEET_METRICS_HOST"] == "0.0.0.0"  # Prometheus scrapes it from its container
        # The exporter alone is published (Prometheus on another node); the engine stays on
        # 127.0.0.1 inside the container.
        from config.settings import Settings

        port = Settings.model_fields["metrics_base_port"].default + gpu
        assert svc["ports"] == [f"${{METRICS_BIND:-127.0.0.1}}:{port}:{port}"]
    others = {n: s for n, s in model["services"].items() if not GPU_SERVICE.match(n)}
    assert not [n for n, s in others.items() if "deploy" in s or "gpus" in s]


def test_model_cache_is_shared_and_read_only_in_workers(compose):
    mounts = [[v for v in svc["volumes"] if isinstance(v, dict)]
              for svc in gpu_services(compose).values()]
    assert all(len(m) == 1 and m[0]["read_only"] is True for m in mounts)
    assert len({(m[0]["source"], m[0]["target"]) for m in mounts}) == 1
    assert env_of(compose["services"]["gpu0"])["HF_HUB_OFFLINE"] == "1"


def test_engine_pinning_agrees_with_the_compose_file(compose):
    from config.launch_profile import load_profile
    from config.settings import Settings
    from workers.engine.lifecycle import EngineSpec
    from workers.node.gpu_group import group_from_queues

    svc = compose["services"]["gpu3"]
    cmd = svc["command"]
    assert group_from_queues([cmd[cmd.index("-Q") + 1]], None)[0].first == 3
    settings = Settings(cuda_device=env_of(svc)["FLEET_CUDA_DEVICE"])
    spec = EngineSpec(kind="sglang", profile=load_profile("qwen36-27b"), gpu=3,
                      host=settings.engine_host, port=settings.engine_port(3),
                      log_path=Path("engine.log"), cuda_device=settings.cuda_device)
    assert spec.env()["CUDA_VISIBLE_DEVICES"] == "0"
    assert spec.env()["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert spec.base_url == "http://127.0.0.1:30003"


def test_compose_for_eight_gpus_as_four_groups_of_two():
    """8 x H100 as 4 engines of 2 GPUs (docs/runbook.md): each service reserves its two host
    GPUs, sees them as devices 0,1, runs one engine with --tp-size 2 and is numbered (queue,
    node, ports) by its first GPU; the i-th starts after i x the stagger."""
    from config.launch_profile import load_profile
    from config.settings import Settings
    from workers.engine.lifecycle import EngineSpec
    from workers.node.gpu_group import group_from_queues

    groups = compose_gen.engine_groups(8, 2)
    text = compose_gen.render(8, 30, groups)
    model = load_compose(text)
    assert model == compose_gen.build(8, 30, groups)
    jsonschema.validate(model, json.loads(SCHEMA.read_text()), cls=jsonschema.Draft7Validator)
    names = [n for n in model["services"] if n.startswith("gpu")]
    assert names == ["gpu0-1", "gpu2-3", "gpu4-5", "gpu6-7"]
    base_port = Settings.model_fields["metrics_base_port"].default
    for i, name in enumerate(names):
        svc, first = model["services"][name], 2 * i
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [str(first), str(first + 1)],
                            "capabilities": ["gpu"]}]
        cmd = svc["command"]
        queue = cmd[cmd.index("-Q") + 1]
        assert queue == name and cmd[cmd.index("-n") + 1] == f"{name}@%h"
        assert delay_of(" ".join(cmd)) == 30 * i
        assert svc["ports"] == [f"${{METRICS_BIND:-127.0.0.1}}:{base_port + first}:"
                                f"{base_port + first}"]
        assert svc["healthcheck"]["test"][-1] == f"{name}@%h"
        env = env_of(svc)
        assert env["FLEET_CUDA_DEVICE"] == "0,1" and "FLEET_GPU" not in env
        group, _ = group_from_queues([queue], None)
        settings = Settings(cuda_device=env["FLEET_CUDA_DEVICE"])
        spec = EngineSpec(kind="sglang", profile=load_profile("qwen36-27b"), gpu=group.first,
                          gpus=group.gpus, host=settings.engine_host,
                          port=settings.engine_port(group.first), log_path=Path("e.log"),
                          cuda_device=settings.cuda_device)
        assert spec.env()["CUDA_VISIBLE_DEVICES"] == "0,1"
        argv = spec.argv()
        assert argv[argv.index("--tp-size") + 1] == "2"
        assert spec.base_url == f"http://127.0.0.1:{30000 + first}"
    assert "gpu0-1:9360, gpu2-3:9362, gpu4-5:9364, gpu6-7:9366" in text


def test_compose_and_procfile_generators_take_a_group_list(tmp_path):
    assert compose_gen.main(["--groups", "0-3,4,5+7", "--out", str(tmp_path / "c.yml")]) == 0
    model = load_compose((tmp_path / "c.yml").read_text())
    gpus = {n: s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for n, s in model["services"].items() if "deploy" in s}
    # '+' is no service name in Compose (nor a process name in honcho): gpu5_7, queue gpu5+7.
    assert gpus == {"gpu0-3": ["0", "1", "2", "3"], "gpu4": ["4"], "gpu5_7": ["5", "7"]}
    cmd = model["services"]["gpu5_7"]["command"]
    assert cmd[cmd.index("-Q") + 1] == "gpu5+7"
    assert env_of(model["services"]["gpu4"])["FLEET_CUDA_DEVICE"] == "0"
    assert compose_gen.main(["--groups", "0-3,4,5+7", "--out", str(tmp_path / "c.yml"),
                             "--check"]) == 0
    for bad in (["--groups", "0-1,1-2"], ["--groups", "0-x"], ["--gpus", "7",
                                                                "--gpus-per-engine", "2"]):
        with pytest.raises(SystemExit):
            compose_gen.main([*bad, "--out", str(tmp_path / "x.yml")])
    procfile = tmp_path / "Procfile"
    assert procfile_gen.main(["--gpus", "8", "--gpus-per-engine", "2", "--out",
                              str(procfile)]) == 0
    procs = parse_procfile(procfile.read_text())
    workers = [n for n in procs if n.startswith("gpu")]
    assert workers == ["gpu0-1", "gpu2-3", "gpu4-5", "gpu6-7"]
    assert [delay_of(procs[n]) for n in workers] == [0, 30, 60, 90]
    assert all(f"-Q {n} -n {n}@%h" in procs[n] for n in workers)
    listed = parse_procfile(procfile_gen.render(groups=compose_gen.engine_groups(0, 1, "0+2")))
    assert "-Q gpu0+2 -n gpu0+2@%h" in listed["gpu0_2"]
    check = subprocess.run([f"{PY}/honcho", "-f", str(procfile), "check"],
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr


def test_fleet_variables_in_compose_are_known_settings(compose):
    from config.settings import S3Settings, Settings, SimSettings

    known = {f"FLEET_{f}".upper() for f in Settings.model_fields}
    known |= {f"FLEET_S3_{f}".upper() for f in S3Settings.model_fields}
    known |= {f"FLEET_SIM_{f}".upper() for f in SimSettings.model_fields}
    used = {k for svc in compose["services"].values() for k in env_of(svc)
            if k.startswith("FLEET_") and k != "FLEET_IMAGE"}
    assert used - known == set()


def test_long_running_services_restart_and_report_health(compose):
    for name, svc in compose["services"].items():
        if name in ONE_SHOT:
            assert svc["restart"] == "no", name
            continue
        assert svc.get("restart") in {"unless-stopped", "always", "on-failure"}, name
        check = svc.get("healthcheck", {})
        assert check.get("test") and check["test"][0] in {"CMD", "CMD-SHELL"}, name
        assert not check.get("disable"), name


def test_no_secret_is_written_in_the_compose_file(compose):
    for name, svc in compose["services"].items():
        for key, value in env_of(svc).items():
            if SECRET_NAME.search(key):
                assert value is None or "${" in value, f"{name}: {key} is inline"
    text = COMPOSE.read_text() + (ROOT / "Procfile").read_text()
    secrets = {v for k, v in env_example().items() if SECRET_NAME.search(k) and v}
    assert secrets <= {"change-me"}  # the example holds placeholders only
    assert "change-me" not in text
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert ".env" in (ROOT / ".dockerignore").read_text().split()


def test_redis_persists_never_evicts_and_needs_a_password(compose):
    svc = compose["services"]["redis"]
    server = " ".join(svc["command"])
    for flag in ("--appendonly yes", "--maxmemory-policy noeviction", "--requirepass"):
        assert flag in server
    assert "redis-data:/data" in svc["volumes"]
    assert "REDISCLI_AUTH" in env_of(svc)  # the health check authenticates


def test_store_flower_and_dashboards_are_wired(compose):
    services = compose["services"]
    assert services["createbucket"]["depends_on"]["minio"]["condition"] == "service_healthy"
    for name in ("sink", *(f"gpu{g}" for g in gpu_services(compose))):
        dep = services[name]["depends_on"]["createbucket"]
        assert dep["condition"] == "service_completed_successfully"
        assert dep["required"] is False  # a worker-only node has no createbucket
    flower = services["flower"]
    assert "FLOWER_PASSWORD" in env_of(flower)["FLOWER_BASIC_AUTH"]
    assert "--conf=deploy/flowerconfig.py" in flower["command"]
    assert "--address=0.0.0.0" in flower["command"]  # hence basic auth is mandatory
    sink_cmd = services["sink"]["command"]
    assert sink_cmd[sink_cmd.index("-Q") + 1] == "sink" and "sink@%h" in sink_cmd
    assert any(v.startswith("./config/prometheus.yml:") for v in services["prometheus"]["volumes"])
    assert any(v.startswith("./config/grafana/") for v in services["grafana"]["volumes"])
    head = {n for n, s in services.items() if "head" in s.get("profiles", [])}
    assert {"redis", "flower", "sink", "prometheus", "grafana", "createbucket"} <= head
    assert not [n for n in gpu_services(compose) if "profiles" in services[f"gpu{n}"]]


# --- the Procfile --------------------------------------------------------------------------


def parse_procfile(text: str) -> dict[str, str]:
    """Process name -> command, as honcho reads a Procfile."""
    from honcho.environ import parse_procfile as honcho_parse

    return dict(honcho_parse(text).processes)


def delay_of(command: str) -> float:
    """The --delay of a supervised command (0 when absent)."""
    m = re.search(r"--delay (\S+)", command)
    return float(m.group(1)) if m else 0.0


def test_procfile_runs_one_supervised_worker_per_gpu_with_staggered_starts():
    procs = parse_procfile((ROOT / "Procfile").read_text())
    gpus = [n for n in procs if GPU_SERVICE.match(n)]
    assert gpus == [f"gpu{g}" for g in range(7)]
    assert {"redis", "flower", "sink"} <= procs.keys()
    for g, name in enumerate(gpus):
        assert f"-Q gpu{g} -n gpu{g}@%h" in procs[name]
        assert "-m deploy.supervise" in procs[name] and "--restart" in procs[name]
    delays = [delay_of(procs[n]) for n in gpus]
    assert delays[0] == 0 and all(b > a for a, b in zip(delays, delays[1:], strict=False))
    assert "noeviction" in procs["redis"] and "--appendonly yes" in procs["redis"]
    assert "--bind 127.0.0.1" in procs["redis"] and "--address=127.0.0.1" in procs["flower"]
    check = subprocess.run([f"{PY}/honcho", "-f", str(ROOT / "Procfile"), "check"],
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    workers_only = parse_procfile(procfile_gen.render(3, 10, workers_only=True))
    assert list(workers_only) == ["gpu0", "gpu1", "gpu2"]


def port_open(port: int) -> bool:
    """Whether something listens on 127.0.0.1:port."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_honcho(procfile: Path, env: dict[str, str], log: Path, *names: str
                 ) -> subprocess.Popen[bytes]:
    """``honcho start NAMES`` on ``procfile`` from the repository root, without any .env."""
    (procfile.parent / "empty.env").write_text("")
    return subprocess.Popen(
        [f"{PY}/honcho", "-f", str(procfile), "-d", str(ROOT), "-e",
         str(procfile.parent / "empty.env"), "--no-colour", "start", *names],
        cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True)


def wait_heartbeats(client: redis.Redis, nodes: set[str], timeout_s: float = 120) -> None:
    """Wait until every node in ``nodes`` reports a healthy engine."""
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            states = {b["node"]: b["engine_state"] for b in heartbeat.read_heartbeats(client)}
        except redis.ConnectionError:
            pass
        if all(states.get(n) == "healthy" for n in nodes):
            return
        time.sleep(0.5)
    raise AssertionError(f"not healthy after {timeout_s:.0f} s: {states}")


def test_procfile_node_and_a_second_node_finish_one_job_against_one_redis(fleet_env, tmp_path):
    """Node A runs the generated Procfile under honcho (redis, gpu0, gpu1 staggered); node B
    joins with its own gpu0 (another host name, engine ports and logs) using node A's Redis
    and the same store. The job completes, verify passes, both nodes did work, and stopping
    honcho leaves nothing running."""
    redis_port = free_port()
    procfile = tmp_path / "Procfile"
    procfile.write_text(procfile_gen.render(2, 1, redis_port=redis_port,
                                            redis_dir=str(tmp_path / "redis")))
    # Redis runs with the password of .env, which needs quoting in a URL; the workers use it.
    password = "h0n/cho#pw?x=1"
    env = {**fleet_env, "FLEET_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
           "REDIS_PASSWORD": password,
           "FLEET_METRICS_ENABLED": "false", "PATH": f"{PY}:{os.environ['PATH']}"}
    node_a = start_honcho(procfile, env, tmp_path / "honcho.log", "redis", "gpu0", "gpu1")
    env_b = {**env, "FLEET_ENGINE_BASE_PORT": str(free_port_block(2)),
             "FLEET_LOG_DIR": str(tmp_path / "nodeB" / "logs")}
    node_b = start_worker(0, env_b, tmp_path / "nodeB", node="gpu0@nodeB", cwd=ROOT)
    host = socket.gethostname()
    nodes_a = {f"gpu0@{host}", f"gpu1@{host}"}
    try:
        client = redis.Redis(port=redis_port, password=password)
        wait_heartbeats(client, nodes_a | {node_b.node})
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=redis_port).ping()
        prompts = write_prompts(tmp_path / "prompts.jsonl", 80)
        res = run_producer(env, "enqueue", str(prompts), "--job", "twonodes",
                           "--batch-size", "10")
        assert res.returncode == 0, res.stderr
        wait_done(env, "twonodes", timeout_s=150)
        res = run_producer(env, "verify", "--job", "twonodes", "--json")
        assert res.returncode == 0 and orjson.loads(res.stdout)["ok"], res.stdout + res.stderr
        rows = {n: int(client.hget(NodeKeys(n).stats, "rows") or 0)
                for n in nodes_a | {node_b.node}}
        assert rows[node_b.node] > 0 and sum(rows[n] for n in nodes_a) > 0, rows
        assert "waiting 1 s before starting" in (tmp_path / "honcho.log").read_text()
        assert "cho#pw" not in (tmp_path / "honcho.log").read_text()
    finally:
        node_b.stop(grace_s=20)
        stop_process(node_a, grace_s=30)
    engine_base = int(fleet_env["FLEET_ENGINE_BASE_PORT"])
    ports = [engine_base, engine_base + 1, redis_port]
    deadline = time.monotonic() + 20  # engines die with their workers (parent-death signal)
    while time.monotonic() < deadline and any(port_open(p) for p in ports):
        time.sleep(0.2)
    assert not any(port_open(p) for p in ports)


# --- the supervisor ------------------------------------------------------------------------

COUNTER = ("import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
           "n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1)); "
           "sys.exit(1 if n == 0 else 0)")


def wait_for(pred: Any, timeout_s: float = 20) -> None:
    """Poll ``pred`` until true or fail."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def supervise(*args: str, stderr: Any = subprocess.PIPE) -> subprocess.Popen[bytes]:
    """Start ``python -m deploy.supervise ARGS`` from the repository root."""
    return subprocess.Popen([sys.executable, "-m", "deploy.supervise", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)


def test_supervisor_restarts_a_failure_and_holds_a_clean_exit(tmp_path):
    counter = tmp_path / "runs"
    err = (tmp_path / "err").open("wb")
    sup = supervise("--restart", "--", sys.executable, "-c", COUNTER, str(counter), stderr=err)
    try:
        # First run fails -> restarted; second exits 0 -> held until SIGHUP.
        wait_for(lambda: "not restarted" in (tmp_path / "err").read_text())
        assert counter.read_text() == "2"
        sup.send_signal(signal.SIGHUP)
        wait_for(lambda: counter.read_text() == "3")
        wait_for(lambda: (tmp_path / "err").read_text().count("not restarted") == 2)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=10) == 0
    finally:
        stop_process(sup, grace_s=5)
        err.close()


def test_supervisor_passes_sigterm_on_and_does_not_restart():
    child = ("import signal, sys, time; "
             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); "
             "print('ready', flush=True); time.sleep(60)")
    sup = supervise("--restart", "--", sys.executable, "-c", child)
    try:
        assert sup.stdout is not None and sup.stdout.readline().strip() == b"ready"
        sup.send_signal(signal.SIGTERM)  # the supervisor only, not its group
        assert sup.wait(timeout=10) == 7
    finally:
        stop_process(sup, grace_s=5)


def test_supervisor_delays_then_execs():
    sup = supervise("--delay", "0.3", "--", sys.executable, "-c", "print('hi')")
    out, err = sup.communicate(timeout=10)
    assert sup.returncode == 0 and out.strip() == b"hi"
    assert b"staggered start" in err


# --- health checks and the bucket ----------------------------------------------------------


def test_heartbeat_health_check(r, redis_server, monkeypatch):
    monkeypatch.setenv("FLEET_REDIS_URL", redis_server.url)
    node = healthcheck.node_name("gpu3@%h")
    assert node == f"gpu3@{socket.gethostname()}"
    assert "no live heartbeat" in (healthcheck.check_heartbeat(node) or "")
    heartbeat.publish(r, node, {"node": node, "engine_state": "starting"}, ttl_s=30)
    assert "engine is starting" in (healthcheck.check_heartbeat(node) or "")
    heartbeat.publish(r, node, {"node": node, "engine_state": "healthy"}, ttl_s=30)
    assert healthcheck.check_heartbeat(node) is None
    assert healthcheck.main(["heartbeat", "gpu3@%h"]) == 0
    assert healthcheck.main(["nonsense", "x"]) == 2


def test_make_bucket_creates_the_store_bucket_once(moto_server, monkeypatch, capsys):
    from deploy import make_bucket
    from tests.s3fixture import AWS_ENV

    for key, value in {**AWS_ENV, "FLEET_STORE_URL": "s3://fleet-deploy-test/runs",
                       "FLEET_S3_ENDPOINT_URL": moto_server.url}.items():
        monkeypatch.setenv(key, value)
    assert make_bucket.main(["--wait-s", "10"]) == 0
    assert make_bucket.main(["--wait-s", "10"]) == 0
    out = capsys.readouterr().out
    assert "fleet-deploy-test created" in out and "fleet-deploy-test already exists" in out
    names = {b["Name"] for b in moto_server.client().list_buckets()["Buckets"]}
    assert "fleet-deploy-test" in names
    monkeypatch.setenv("FLEET_STORE_URL", "file:///tmp/not-s3")
    assert make_bucket.main([]) == 1




# --- issue 17: where the data lives, what reaches the containers, secrets -------------------


def fleet_services(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services that run this repository's code (built from its Dockerfile)."""
    return {n: s for n, s in model["services"].items() if "build" in s}


def test_an_empty_endpoint_means_aws_and_minio_is_an_explicit_choice(compose):
    from config.settings import S3Settings
    from workers.dataset.location import locate

    env = env_example()
    assert "minio" not in env["COMPOSE_PROFILES"].split(",")
    for name, svc in fleet_services(interpolate(compose, env)).items():
        svc_env = env_of(svc)
        if "FLEET_STORE_URL" not in svc_env:
            continue
        endpoint = S3Settings(endpoint_url=svc_env["FLEET_S3_ENDPOINT_URL"]).endpoint_url
        assert endpoint is None, name
        assert locate(svc_env["FLEET_STORE_URL"], endpoint).where == "off-node", name
    minio = env_of(interpolate(compose, {**env, "S3_ENDPOINT_URL": "http://minio:9000"})
                   ["services"]["sink"])
    assert locate(minio["FLEET_STORE_URL"], minio["FLEET_S3_ENDPOINT_URL"]).where == "node"


REAL_SECRETS = {"REDIS_PASSWORD": "0d9f8e7a6b5c", "AWS_ACCESS_KEY_ID": "fleetkey",
                "AWS_SECRET_ACCESS_KEY": "3c2b1a0f9e8d", "FLOWER_PASSWORD": "a1b2c3d4e5f6",
                "GRAFANA_PASSWORD": "f6e5d4c3b2a1"}
TYPED = {"FLEET_S3_REGION": ("eu-central-1", lambda s: s.s3.region),
         "FLEET_ENGINE_WAIT_S": ("123", lambda s: s.engine_wait_s),
         "FLEET_POISON_CRASHES": ("7", lambda s: s.poison_crashes),
         "FLEET_STORE_RETRY_ATTEMPTS": ("4", lambda s: s.store_retry_attempts),
         "FLEET_SHARD_ROWS": ("5000", lambda s: s.shard_rows),
         "FLEET_REQUEST_TIMEOUT_S": ("99", lambda s: s.request_timeout_s)}


def test_every_fleet_setting_in_env_reaches_every_fleet_container(compose, monkeypatch):
    """Every FLEET_* config/settings.py reads or .env.example names, set in .env, arrives in
    every fleet container; only the Redis part skips the bucket job and the store part skips
    Flower (they need neither), and the per-container values stay the generator's."""
    from config.settings import Settings

    named = set(re.findall(r"^#?\s*(FLEET_[A-Z0-9_]+)=", ENV_EXAMPLE.read_text(), re.M))
    names = (set(compose_gen.setting_names()) | named) - set(compose_gen.GENERATED)
    names.discard("FLEET_IMAGE")  # the image of the services, not a setting
    env = {**env_example(), **REAL_SECRETS, **{n: f"v-{n.lower()}" for n in names}}
    model = interpolate(compose, env)
    redis_part, store_part = set(compose_gen.redis_env()), set(compose_gen.store_env())
    services = fleet_services(model)
    services.pop("preflight")  # only checks the secrets of .env; reads no setting
    assert {"sink", "flower", "createbucket", "model-download", "gpu0", "gpu6"} <= set(services)
    for name, svc in services.items():
        svc_env = env_of(svc)
        for var in names:
            if var in redis_part and name in {"createbucket", "model-download"}:
                assert var not in svc_env, (name, var)
            elif var in store_part and name in {"flower", "model-download"}:
                assert var not in svc_env, (name, var)
            else:
                assert svc_env.get(var) == f"v-{var.lower()}", (name, var)
    gpu = env_of(model["services"]["gpu2"])
    assert (gpu["FLEET_CUDA_DEVICE"], gpu["FLEET_ENGINE"], gpu["FLEET_LOG_DIR"]) == (
        "0", "sglang", "/app/logs")
    assert "FLEET_GPU" not in gpu
    # The values are read as settings inside the container; unset ones keep their defaults.
    typed = {**env_example(), **REAL_SECRETS, **{k: v for k, (v, _) in TYPED.items()}}
    settings = settings_in(env_of(interpolate(compose, typed)["services"]["gpu2"]), monkeypatch)
    for var, (value, read) in TYPED.items():
        assert str(read(settings)).removesuffix(".0") == value, var
    assert settings.visibility_timeout_s == Settings.model_fields["visibility_timeout_s"].default


def test_placeholder_secrets_stop_the_head_services_before_they_start(compose):
    services = compose["services"]
    for name in ("redis", "minio", "flower", "grafana"):
        dep = services[name]["depends_on"]["preflight"]
        assert dep["condition"] == "service_completed_successfully", name
    check = env_of(interpolate(compose, env_example())["services"]["preflight"])
    res = subprocess.run([sys.executable, "-m", *services["preflight"]["command"][2:]],
                         env={**os.environ, **check}, cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 1, res.stderr
    for var in ("REDIS_PASSWORD", "FLOWER_PASSWORD", "GRAFANA_PASSWORD", "AWS_SECRET_ACCESS_KEY"):
        assert var in res.stderr
    real = env_of(interpolate(compose, {**env_example(), **REAL_SECRETS})["services"]["preflight"])
    res = subprocess.run([sys.executable, "-m", "deploy.preflight"], cwd=ROOT,
                         env={**os.environ, **real}, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    procs = parse_procfile((ROOT / "Procfile").read_text())
    assert procs["redis"].startswith("python -m deploy.preflight redis && ")
    assert '--requirepass "$REDIS_PASSWORD"' in procs["redis"]


def test_each_service_gets_only_the_secrets_it_needs(compose):
    services = compose["services"]
    assert not [k for k in env_of(services["flower"]) if k.startswith("AWS_")]
    redis_credentials = ("FLEET_REDIS_URL", "FLEET_REDIS_PASSWORD", "REDIS_PASSWORD",
                         "REDISCLI_AUTH")
    bucket = env_of(services["createbucket"])
    assert not [k for k in bucket if k in redis_credentials]
    download = env_of(services["model-download"])
    assert not [k for k in download if k.startswith("AWS_") or k in redis_credentials]
    for name in ("redis", "prometheus", "grafana", "minio"):
        assert not [k for k in env_of(services[name]) if k.startswith(("AWS_", "FLEET_"))
                    and name != "minio"], name


def duration_s(text: str) -> float:
    """Seconds of a Compose duration ('5m', '1m30s', '90s')."""
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", text))


def test_stop_grace_covers_handing_batches_back_through_a_slow_store(compose):
    """The grace period is for the hand-back (store retries at their worst, then the engine's
    stop), not for finishing a batch; it comes from .env (STOP_GRACE_PERIOD) when set."""
    from config.settings import Settings
    from workers.dataset.store import store_policy

    settings = Settings()
    policy = store_policy(settings)
    # workers/retry.py backoff_s at its longest (full jitter) between every two attempts.
    worst_store_s = sum(min(policy.max_s, policy.base_s * 2 ** (a - 1)) * (1 + policy.jitter)
                        for a in range(1, policy.max_attempts))
    engine_stop_s = settings.engine_stop_grace_s + 5  # workers/engine/lifecycle.py Engine.stop
    model = interpolate(compose, env_example())
    for gpu, svc in gpu_services(model).items():
        assert duration_s(svc["stop_grace_period"]) >= worst_store_s + engine_stop_s, gpu
    custom = interpolate(compose, {**env_example(), "STOP_GRACE_PERIOD": "7m"})
    assert custom["services"]["gpu0"]["stop_grace_period"] == "7m"


def test_exporters_are_published_on_metrics_bind_only(compose):
    from config.settings import Settings

    base = Settings.model_fields["metrics_base_port"].default
    env = {**env_example(), "METRICS_BIND": "10.0.0.7"}
    model = interpolate(compose, env)
    workers = gpu_services(model)
    published = sorted(p for svc in workers.values() for p in svc["ports"])
    assert published == sorted(f"10.0.0.7:{base + g}:{base + g}" for g in workers)
    default = interpolate(compose, env_example())
    assert all(p.startswith("127.0.0.1:") for svc in default["services"].values()
               for p in svc.get("ports", [])), "every port is on loopback unless .env says"


def test_gpu_workers_have_open_files_kernel_caches_and_rotating_logs(compose):
    from workers.engine.lifecycle import engine_base_env

    model = interpolate(compose, env_example())
    for gpu, svc in gpu_services(model).items():
        nofile = svc["ulimits"]["nofile"]
        assert nofile["soft"] == nofile["hard"] >= 65536, gpu  # SGLang's own advice: 65535+
        cache = next(v for v in svc["volumes"] if isinstance(v, str) and v.startswith("jit-"))
        volume, target = cache.split(":")
        assert volume in model["volumes"]
        env = env_of(svc)
        jit = {k: v for k, v in env.items() if k in compose_gen.JIT_ENV}
        assert jit and all(v.startswith(target) for v in jit.values()), gpu
        # The engine inherits them (workers/engine/lifecycle.py keeps only what it needs).
        assert set(jit) <= set(engine_base_env({k: v or "" for k, v in env.items()})), gpu
    for name, svc in model["services"].items():
        options = svc["logging"]["options"]
        assert svc["logging"]["driver"] == "json-file" and options["max-size"], name
        assert int(options["max-file"]) >= 1, name


def test_the_image_is_pinned_by_digest_or_the_build_refuses(compose):
    dockerfile = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in dockerfile.splitlines() if line.strip()
             and not line.startswith("#")]
    assert lines[1] == "FROM ${SGLANG_IMAGE}"
    check = next(i for i, line in enumerate(lines) if "check_pinned.sh" in line
                 and line.startswith("RUN"))
    pip = next(i for i, line in enumerate(lines) if "pip install" in line)
    assert check < pip, "the check runs before anything is installed"
    assert "requirements.lock" in lines[pip] and any(
        line.startswith("COPY") and "requirements.lock" in line for line in lines[:pip])
    build = compose["services"]["gpu0"]["build"]["args"]
    assert "SGLANG_IMAGE" in build and "ALLOW_UNPINNED_BASE" in build
    script = str(ROOT / "deploy" / "check_pinned.sh")
    tag = interpolate(build, env_example())["SGLANG_IMAGE"]
    refused = subprocess.run(["sh", script, tag, "0"], capture_output=True, text=True)
    assert refused.returncode == 1 and "not pinned by digest" in refused.stderr
    warned = subprocess.run(["sh", script, tag, "1"], capture_output=True, text=True)
    assert warned.returncode == 0 and "WARNING" in warned.stderr
    pinned = f"{tag.split(':')[0]}@sha256:{'0a' * 32}"
    ok = subprocess.run(["sh", script, pinned, "0"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    short = subprocess.run(["sh", script, f"{pinned[:-2]}", "0"], capture_output=True, text=True)
    assert short.returncode == 1
