"""Job names are checked in full (no trailing newline) on every command, before anything runs."""

from __future__ import annotations

import pytest

from producer.cli import RET_JOB
from tests.conftest import run_producer, write_prompts
from workers.dataset.jobs import check_job_name
from workers.errors import JobError

BAD = ("job\n", "job\r\n", "../x", "a b", "*", "", "-x", "j" * 129)


def test_check_job_name_matches_the_whole_name():
    for name in BAD:
        with pytest.raises(JobError):
            check_job_name(name)
    assert check_job_name("regen-2026.11_a") == "regen-2026.11_a"


def test_every_command_refuses_a_name_with_a_trailing_newline(fleet_env, tmp_path, r):
    src = write_prompts(tmp_path / "p.jsonl", 4)
    commands = [
        ("enqueue", str(src), "--job", "bad\n"),
        ("enqueue", str(src), "--job", "ok", "--reuse-from", "old\n"),
        ("status", "--job", "bad\n"), ("verify", "--job", "bad\n"),
        ("pause", "--job", "bad\n"), ("resume", "--job", "bad\n"),
        ("cancel", "--job", "bad\n"), ("requeue-failed", "--job", "bad\n"),
        ("sink", "--job", "bad\n"), ("export", "--job", "bad\n", "--out", str(tmp_path / "o")),
        ("report", "--job", "bad\n", "--out", str(tmp_path / "rep")),
    ]
    for args in commands:
        res = run_producer(fleet_env, *args)
        assert res.returncode == RET_JOB, (args, res.stderr)
        assert "invalid job name" in res.stderr and "Traceback" not in res.stderr, args
    assert r.keys("*") == []  # nothing was written for any of them


def test_gpu_queue_names_are_matched_in_full():
    from workers.errors import FleetError
    from workers.node.gpu_group import group_from_queues

    assert group_from_queues(["gpu3", "gpu"], None)[0].first == 3
    with pytest.raises(FleetError):
        group_from_queues(["gpu3\n", "gpu"], None)
