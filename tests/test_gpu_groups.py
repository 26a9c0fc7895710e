"""Workers that own a GPU group (``gpu0-1``) and one tensor-parallel engine on it (issue 22).

The parser and the tp-size arithmetic are checked as functions; the rest runs real workers
(celery processes with simulated engines) against the session's redis-server: a group worker
beside a one-GPU worker finishing one job exactly once, each refusal as one line, and a group
worker killed mid-batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from config.launch_profile import LaunchProfile, load_profile
from producer.localfleet import WorkerProcess, stop_workers, wait_healthy
from tests.conftest import ROOT, run_producer, wait_done, write_prompts
from tests.test_delivery import _rows, _verify, _wait_for
from workers.engine.capacity import EngineFlags, model_shape, plan_capacity
from workers.engine.lifecycle import EngineSpec, ParallelismMismatch, group_profile
from workers.node import gpu_group
from workers.node.gpu_group import GpuGroup, GroupError, group_from_queues, parse_group
from workers.redisdb.keys import NodeKeys, gpu_owner_key
from workers.tune import gpu as nvml

HOST = "grp"  # the host part of every node name here: one node, so the claims collide
NVML = ROOT / "tests" / "fixtures" / "tune" / "nvml"


# --- the one parser of queue names --------------------------------------------------------


@pytest.mark.parametrize(("name", "gpus", "label"), [
    ("gpu3", (3,), "3"), ("gpu0-1", (0, 1), "0-1"), ("gpu4-7", (4, 5, 6, 7), "4-7"),
    ("gpu0+1", (0, 1), "0-1"), ("gpu2+0", (0, 2), "0+2"), ("gpu12", (12,), "12"),
])
def test_queue_names_name_their_gpus(name, gpus, label):
    group = parse_group(name)
    assert (group.gpus, group.label, group.name) == (gpus, label, f"gpu{label}")
    assert group.cuda_visible_devices == ",".join(map(str, gpus))


@pytest.mark.parametrize("name", ["gpu0-x", "gpu1-0", "gpu2-2", "gpu0+0", "gpu-1", "gpu0-1-2",
                                  "gpu+1", "gpus", "gpu3\n", "gpu 3", "gpu0,1", "gpu0-1+2"])
def test_a_name_that_names_no_gpu_is_refused_not_guessed(name):
    with pytest.raises(GroupError, match="names no GPU"):
        parse_group(name)
    with pytest.raises(GroupError):
        group_from_queues([name, "gpu"], None)


def test_fleet_gpu_and_the_queue_must_agree():
    # The report: -Q gpu0-1 beside FLEET_GPU=2 took GPU 2 (the override won).
    with pytest.raises(GroupError, match="FLEET_GPU=2"):
        group_from_queues(["gpu0-1", "gpu"], "2")
    assert group_from_queues(["gpu0-1"], "0-1") == (GpuGroup((0, 1)), "gpu0-1")
    assert group_from_queues(["gpu0+1"], "gpu0-1") == (GpuGroup((0, 1)), "gpu0+1")
    assert group_from_queues(["gpu"], "2-3") == (GpuGroup((2, 3)), "gpu2-3")
    with pytest.raises(GroupError, match="exactly one GPU queue"):
        group_from_queues(["gpu0", "gpu1"], None)
    with pytest.raises(GroupError, match="name no GPU"):
        group_from_queues(["gpu", "sink"], None)
    assert not gpu_group.is_gpu_queue("gpu")  # the shared queue


# --- tp-size from the group ------------------------------------------------------------------


def _spec(profile: LaunchProfile, gpus: tuple[int, ...], cuda: str | None = None) -> EngineSpec:
    return EngineSpec(kind="sim", profile=profile, gpu=gpus[0], gpus=gpus, host="127.0.0.1",
                      port=30000 + gpus[0], log_path=Path("engine.log"), cuda_device=cuda)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_a_group_engine_runs_on_every_gpu_with_tp_size_of_the_group():
    base = load_profile("qwen36-27b")
    spec = _spec(base, (2, 3))
    assert spec.env()["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert spec.env()["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert _flag(spec.argv(), "--tp-size") == "2" and spec.tp_size == 2
    assert spec.profile == base  # the profile (and its digest) stays the user's
    single = _spec(base, (3,))
    assert "--tp-size" not in single.argv() and single.env()["CUDA_VISIBLE_DEVICES"] == "3"
    # A container numbers its GPUs from 0.
    assert _spec(base, (2, 3), cuda="0,1").env()["CUDA_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.parametrize(("flags", "gpus", "tp"), [
    ({"tp-size": 2}, 2, 2), ({"dp-size": 2}, 2, 1), ({"tp-size": 2, "dp-size": 2}, 4, 2),
    ({"tensor-parallel-size": 4}, 4, 4),
    ({"tp-size": 2, "dp-size": 2, "enable-dp-attention": True}, 2, 2),
])
def test_a_profile_that_sets_its_sizes_must_cover_the_group(flags, gpus, tp):
    profile = load_profile("qwen36-27b").with_flags("p", **{k.replace("-", "_"): v
                                                            for k, v in flags.items()})
    spec = _spec(profile, tuple(range(gpus)))
    argv = spec.argv()
    assert spec.tp_size == tp
    # What the profile says is launched as it says it, with nothing added.
    assert argv.count("--tp-size") + argv.count("--tensor-parallel-size") == (
        "tp-size" in flags or "tensor-parallel-size" in flags)


@pytest.mark.parametrize(("flags", "gpus"), [
    ({"tp-size": 2, "dp-size": 2}, 2), ({"tp-size": 1}, 2), ({"tp-size": 2}, 1),
    ({"dp-size": 3}, 2), ({"tp-size": "two"}, 2),
])
def test_tp_times_dp_other_than_the_group_size_is_refused(flags, gpus):
    profile = load_profile("qwen36-27b").with_flags("wide", **{k.replace("-", "_"): v
                                                               for k, v in flags.items()})
    with pytest.raises(ParallelismMismatch, match="wide") as err:
        _spec(profile, tuple(range(gpus)))
    assert "\n" not in str(err.value)
    with pytest.raises(ParallelismMismatch, match="queue gpu0-1"):
        group_profile(profile, gpus, "queue gpu0-1")


# --- claims -------------------------------------------------------------------------------


def test_claims_are_all_or_none_and_name_the_owner(r: redis.Redis):
    gpu_group.claim(r, f"gpu0-1@{HOST}", GpuGroup((0, 1)), "gpu0-1", 30)
    with pytest.raises(GroupError, match=f"queue gpu1-2: GPU 1 is owned by gpu0-1@{HOST}"):
        gpu_group.claim(r, f"gpu1-2@{HOST}", GpuGroup((1, 2)), "gpu1-2", 30)
    assert not r.exists(gpu_owner_key(HOST, 2))  # none of gpu1-2's claims was made
    gpu_group.claim(r, f"gpu0-1@{HOST}", GpuGroup((0, 1)), "gpu0-1", 30)  # its own: renewed
    gpu_group.claim(r, "gpu1@other", GpuGroup((1,)), "gpu1", 30)  # another node's GPU 1
    gpu_group.release(r, f"gpu1-2@{HOST}", GpuGroup((1, 2)))  # not its claims: nothing
    assert r.get(gpu_owner_key(HOST, 1)) == f"gpu0-1@{HOST}".encode()
    gpu_group.release(r, f"gpu0-1@{HOST}", GpuGroup((0, 1)))
    gpu_group.claim(r, f"gpu1-2@{HOST}", GpuGroup((1, 2)), "gpu1-2", 30)


# --- NVML per group and the simulator at tp > 1 -------------------------------------------


def test_a_group_reads_every_gpu_and_the_least_free_one_binds(monkeypatch):
    capture = json.loads((NVML / "h200x2_pinned_gpu1.json").read_text())  # 12 GiB on GPU 1
    raws = [capture["0"]["raw"], capture["1"]["raw"]]
    section = nvml.to_group_section(raws)
    assert [s["index"] for s in section["group"]] == [0, 1]
    assert section["index"] == 1
    assert section["memory_free_mib"] == min(s["memory_free_mib"] for s in section["group"])
    assert section["memory_free_mib"] < section["group"][0]["memory_free_mib"]
    assert all("utilization_gpu_pct" in s for s in section["group"])
    assert "group" not in nvml.to_group_section(raws[:1])
    monkeypatch.delenv("FLEET_CUDA_DEVICE", raising=False)
    assert nvml.nvml_indices([2, 3]) == [2, 3]
    monkeypatch.setenv("FLEET_CUDA_DEVICE", "0,1")  # a container holding host GPUs 2 and 3
    assert nvml.nvml_indices([2, 3]) == [0, 1]


def test_the_simulator_sizes_its_pools_per_gpu_at_tp_size(tmp_path):
    from config.settings import SimSettings
    from workers.sim.api import server_info
    from workers.sim.flags import parse_args
    from workers.sim.server import build_state

    base = load_profile("qwen36-27b")
    sim = SimSettings(startup_s=0.0)
    infos = {}
    for tp in (1, 2):
        argv = group_profile(base, tp).to_argv()
        infos[tp] = server_info(build_state(parse_args(argv), sim))
        plan = plan_capacity(model_shape(base.flags["model-path"]),
                             EngineFlags.from_flags(base.flags | {"tp-size": tp}),
                             sim.gpu_memory_mib)
        assert infos[tp]["tp_size"] == tp
        assert infos[tp]["internal_states"][0]["tp_size"] == tp
        assert infos[tp]["max_total_num_tokens"] == plan.max_total_num_tokens
        usage = infos[tp]["internal_states"][0]["memory_usage"]
        assert usage["weight"] == pytest.approx(plan.memory_gib["weights"], abs=0.01)
    # Half the weights per GPU leaves more room for the KV cache, whose cells are halved too.
    assert infos[2]["max_total_num_tokens"] > 2 * infos[1]["max_total_num_tokens"]


def test_tune_plan_counts_one_engine_per_group():
    from workers.tune.plan import JobSize, plan

    base = load_profile("qwen36-27b")
    job = JobSize(gpus=8, prompts=10_000, avg_output_tokens=2000, gpu_price_per_hour=2.0)
    one, two = plan(base, job, 183_359), plan(group_profile(base, 2), job, 183_359)
    assert (one["tp_size"], one["engines"], two["tp_size"], two["engines"]) == (1, 8, 2, 4)
    assert two["tok_s_total"] == pytest.approx(two["tok_s_per_gpu"] * 4, abs=1)
    assert two["cost"] == pytest.approx(two["eta_hours"] * 8 * 2.0, rel=0.01)  # all 8 GPUs


# --- real workers ---------------------------------------------------------------------------


def _argv(queue: str, node: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", queue, "-n", node,
            "-l", "INFO", "--without-mingle", "--without-gossip"]


@pytest.fixture()
def start(fleet_env: dict[str, str], tmp_path: Path, r: redis.Redis
          ) -> Iterator[Callable[..., WorkerProcess]]:
    """Factory: a worker consuming ``queue`` as ``<queue>@grp`` (not waited for)."""
    started: list[WorkerProcess] = []

    def make(queue: str, **env: str) -> WorkerProcess:
        node = f"{queue}@{HOST}"
        log_path = tmp_path / "logs" / f"worker-{queue}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full = {**fleet_env, **env}
        proc = subprocess.Popen(_argv(queue, node), env=full, cwd=ROOT,
                                stdout=log_path.open("ab"), stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        w = WorkerProcess(gpu=parse_group(queue).first, node=node, proc=proc,
                          log_path=log_path, env=full)
        started.append(w)
        return w

    yield make
    stop_workers(started, grace_s=20)


def _refusal(env: dict[str, str], queue: str, node: str | None = None) -> str:
    """Start a worker that must be refused; its one refusal line."""
    res = subprocess.run(_argv(queue, node or f"{queue}@{HOST}"), env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0, res.stdout + res.stderr
    lines = [x for x in res.stderr.splitlines() if "refused" in x]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def _beat(r: redis.Redis, node: str) -> dict:
    return orjson.loads(r.get(f"fleet:worker:{node}"))


def test_a_group_worker_beside_a_single_gpu_worker_finish_one_job_exactly_once(
        fleet_env, start, tmp_path, r: redis.Redis):
    group, single = start("gpu0-1"), start("gpu2")
    wait_healthy(r, [group, single], timeout_s=90)
    beat = _beat(r, group.node)
    assert (beat["gpus"], beat["group"], beat["queue"], beat["tp_size"]) == ([0, 1], "0-1",
                                                                             "gpu0-1", 2)
    base = int(fleet_env["FLEET_ENGINE_BASE_PORT"])
    assert beat["port"] == base  # the group's first GPU
    info = httpx.get(f"http://127.0.0.1:{base}/server_info", timeout=5).json()
    assert info["tp_size"] == 2
    environ = Path(f"/proc/{beat['engine_pid']}/environ").read_bytes().split(b"\0")
    assert b"CUDA_VISIBLE_DEVICES=0,1" in environ
    assert (tmp_path / "logs" / "engine-gpu0-1.log").exists()
    assert _beat(r, single.node)["tp_size"] == 1
    metrics = httpx.get(f"http://127.0.0.1:{fleet_env['FLEET_METRICS_BASE_PORT']}/metrics",
                        timeout=5).text
    assert f'fleet_worker_gpus{{gpu="0-1",node="{group.node}"}} 2.0' in metrics

    src = write_prompts(tmp_path / "p.jsonl", 120)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "mix", "--batch-size",
                        "10").returncode == 0
    st = wait_done(fleet_env, "mix", timeout_s=180)
    assert st["completed"] == 120
    report = _verify(fleet_env, "mix")
    assert report["ok"] and report["duplicates"] == 0 and report["rows"] == 120, report
    rows = {n: int(r.hget(NodeKeys(n).stats, "rows") or 0)
            for n in (group.node, single.node)}
    assert all(rows.values()) and sum(rows.values()) == 120, rows
    table = run_producer(fleet_env, "status", "--job", "mix")
    assert table.returncode == 0 and "0-1" in table.stdout, table.stdout


def test_each_refusal_is_one_line_naming_the_queue(fleet_env, start, tmp_path, r: redis.Redis):
    line = _refusal(fleet_env, "gpu0-x")
    assert "gpu0-x" in line and "names no GPU" in line
    assert "FLEET_GPU=2" in _refusal({**fleet_env, "FLEET_GPU": "2"}, "gpu0-1")
    wide = tmp_path / "wide.toml"
    wide.write_text('[flags]\nmodel-path = "Qwen/Qwen3.6-27B"\ntp-size = 2\ndp-size = 2\n')
    line = _refusal({**fleet_env, "FLEET_PROFILE": str(wide)}, "gpu0-1")
    assert "queue gpu0-1 is 2 GPU(s)" in line and "tp-size 2 x dp-size 2 = 4" in line
    assert "FLEET_CUDA_DEVICE" in _refusal({**fleet_env, "FLEET_CUDA_DEVICE": "0"}, "gpu0-1")

    owner = start("gpu0-1")
    wait_healthy(r, [owner], timeout_s=90)
    line = _refusal(fleet_env, "gpu1")
    assert f"queue gpu1: GPU 1 is owned by {owner.node}" in line
    assert f"owned by {owner.node}" in _refusal(fleet_env, "gpu1-2")
    assert not r.exists(gpu_owner_key(HOST, 2))
    assert [b["node"] for b in _live(r)] == [owner.node]  # nothing else ever ran
    owner.stop(grace_s=20)  # a warm shutdown hands the GPUs back at once
    assert not r.exists(gpu_owner_key(HOST, 0))


def _live(r: redis.Redis) -> list[dict]:
    from workers.node.heartbeat import read_heartbeats

    return read_heartbeats(r)


def test_a_group_worker_killed_mid_batch_loses_and_doubles_nothing(fleet_env, start, tmp_path,
                                                                  r: redis.Redis):
    slow = {"FLEET_SIM_SPEED": "1", "FLEET_SIM_MEAN_OUTPUT_TOKENS": "300"}
    group = start("gpu0-1", **slow)
    wait_healthy(r, [group], timeout_s=90)
    src = write_prompts(tmp_path / "p.jsonl", 200)
    assert run_producer(fleet_env, "enqueue", str(src), "--job", "gk", "--batch-size",
                        "100").returncode == 0
    _wait_for(lambda: int(r.hget("fleet:job:gk:stats", "completed") or 0) >= 20, 90,
              "progress on the group before the kill")
    group.kill()  # SIGKILL: no hand-back, no release; the engine dies with its parent
    # Its claims outlive it (until they expire, 30 s): GPU 1 is not handed out meanwhile.
    assert f"GPU 1 is owned by {group.node}" in _refusal(fleet_env, "gpu1")
    other = start("gpu2", FLEET_SIM_SPEED="10", FLEET_SIM_MEAN_OUTPUT_TOKENS="60")
    _wait_for(lambda: any((r.get(f"fleet:job:gk:owner:{b}") or b"").startswith(
        f"{other.node}|".encode()) for b in (0, 1)), 120, "redelivery to the gpu2 worker")
    wait_done(fleet_env, "gk", timeout_s=180)
    report = _verify(fleet_env, "gk")
    assert report["ok"] and report["duplicates"] == 0 and report["rows"] == 200, report
    nodes = {row["node"] for row in _rows(fleet_env, "gk")}
    assert nodes == {group.node, other.node}  # rows the group answered were kept, not redone
