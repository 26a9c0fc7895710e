"""Supported SGLang releases: fixtures in each one's formats, the check at start (older refused,
newer started with a warning), and the tuner saying what it could not read (issues #13, #21)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from config.launch_profile import load_profile
from workers.engine.lifecycle import Engine, EngineSpec
from workers.engine.log import parse_log
from workers.engine.versions import SUPPORTED, UnsupportedVersion, check_version, version_warning
from workers.tune import snapshot
from workers.tune.diagnose import diagnose

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
CAPS = {"0.5.10.post1": 20, "0.5.11": 16}  # 80 slots // R (4 without spec v2, 5 with it)


def test_every_supported_release_has_a_fixture_folder() -> None:
    assert sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) == sorted(SUPPORTED)
    assert all((FIXTURES / v / "formats" / "lines.json").is_file() for v in SUPPORTED)


@pytest.mark.parametrize("version", sorted(CAPS))
def test_each_release_is_read_in_full_and_its_arithmetic_reproduces_the_cap(version) -> None:
    log = parse_log((FIXTURES / version / "engine.log").read_text())
    assert log.unread == []
    assert log.scheduler is not None and log.kv_tokens and log.mamba is not None
    assert log.draft_weights_gib is not None  # the second Load weight end on rank 0
    d = diagnose(snapshot.load(FIXTURES / version)).to_json()
    assert d["unread_evidence"] == []
    current = d["memory_model"]["current"]
    assert current["max_running_requests"] == CAPS[version] == log.scheduler.max_running_requests
    assert current["kv_tokens"] == log.scheduler.max_total_num_tokens


def test_a_newer_release_is_named_and_its_unknown_lines_listed(tmp_path: Path) -> None:
    snap_dir = tmp_path / "snap"
    shutil.copytree(FIXTURES / "0.5.11", snap_dir)
    log = (snap_dir / "engine.log").read_text()
    # A KV line in a format no known release prints.
    log = log.replace("KV Cache is allocated. #tokens: 1137037, K size: 17.35 GB",
                      "KV Cache is allocated. layout: paged, #tokens: 1137037, K size: "
                      "17.35 GB", 1)
    (snap_dir / "engine.log").write_text(log)
    info = (snap_dir / "server_info.json").read_text().replace('"0.5.11"', '"0.5.24"')
    (snap_dir / "server_info.json").write_text(info)
    unread = diagnose(snapshot.load(snap_dir)).to_json()["unread_evidence"]
    assert any("version 0.5.24" in u and "explicit_cap_rule" in u for u in unread)
    assert any("layout: paged" in u for u in unread)
    assert any(u.startswith("KV bytes per token from the model's config") for u in unread)
    # `tune plan` calibrated from that snapshot says the same, in JSON and in its table.
    argv = [sys.executable, "-m", "workers.tune", "plan", "--profile", "qwen36-27b", "--gpus",
            "1", "--prompts", "1000", "--avg-output-tokens", "2000", "--snapshot", str(snap_dir)]
    got = subprocess.run([*argv, "--json"], capture_output=True, text=True, check=True)
    assert orjson.loads(got.stdout)["unread_evidence"] == unread
    table = subprocess.run(argv, capture_output=True, text=True, check=True,
                           env={**os.environ, "COLUMNS": "400"}).stdout
    assert "not read: " in table and "version 0.5.24" in table


def test_tp_ranks_other_than_0_do_not_count_as_the_draft_model() -> None:
    lines = [
        "[2026-05-07 11:50:10 TP0] Load weight begin. avail mem=178.52 GB",
        "[2026-05-07 11:50:10 TP1] Load weight begin. avail mem=178.52 GB",
        "[2026-05-07 11:51:46 TP0] Load weight end. elapsed=96.31 s, type=X, avail mem=124.52 GB,"
        " mem usage=27.00 GB.",
        "[2026-05-07 11:51:46 TP1] Load weight end. elapsed=96.31 s, type=X, avail mem=124.52 GB,"
        " mem usage=27.00 GB.",
    ]
    log = parse_log("\n".join(lines))
    assert log.weights_gib == 27.0 and log.draft_weights_gib is None


def test_check_version_refuses_older_releases_with_one_line() -> None:
    assert check_version("0.5.11", "engine").spec_v2_default is True
    assert check_version("0.5.10.post1", "engine").spec_v2_default is False
    assert check_version("0.5.23", "engine").version == "0.5.23"
    assert check_version("0.5.24", "engine").explicit_cap_rule == "min_half_tokens"
    for old in ("0.5.10", "0.5.9", "0.4.10.post2", None, "nightly"):
        with pytest.raises(UnsupportedVersion) as err:
            check_version(old, "engine on GPU 0")
        message = str(err.value)
        assert "\n" not in message and "0.5.10.post1" in message and "0.5.23" in message
    assert version_warning("0.5.23", "engine") is None
    warning = version_warning("0.5.24", "engine on GPU 0")
    assert warning is not None and "\n" not in warning and "0.5.24" in warning


def test_worker_engine_refuses_an_older_release_and_warns_on_a_newer_one(
        tmp_path: Path, monkeypatch, caplog) -> None:
    from producer.localfleet import free_port

    monkeypatch.setenv("FLEET_SIM_STARTUP_S", "0.1")
    for version, ok in (("0.5.9", False), ("0.5.24", True), ("0.5.10.post1", True)):
        monkeypatch.setenv("FLEET_SIM_SGLANG_VERSION", version)
        spec = EngineSpec(kind="sim", profile=load_profile("qwen36-27b"), gpu=0,
                          host="127.0.0.1", port=free_port(), log_path=tmp_path / f"{version}.log",
                          stop_grace_s=2.0)
        engine = Engine(spec)
        engine.start()
        caplog.clear()
        try:
            if ok:
                with caplog.at_level(logging.WARNING, logger="workers.engine.versions"):
                    engine.wait_ready(60.0)
                warned = [r.getMessage() for r in caplog.records if "newer than" in r.getMessage()]
                assert len(warned) == (1 if version == "0.5.24" else 0)
            else:
                with pytest.raises(UnsupportedVersion, match="runs SGLang 0.5.9"):
                    engine.wait_ready(60.0)
        finally:
            engine.stop()
