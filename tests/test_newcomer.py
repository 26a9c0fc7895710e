"""Issue 45: a newcomer's path, second pass (one test or more per item)."""

from __future__ import annotations

from pathlib import Path

import pytest

from producer import demo
from producer.localfleet import RedisServer, free_port


def test_demo_starts_its_own_redis_unless_fleet_redis_url_is_set(
        redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 1: without FLEET_REDIS_URL the demo never uses a Redis that merely answers."""
    url, server = demo._redis(None, tmp_path / "redis")
    try:
        assert server is not None and server.port != redis_server.port
        assert url == server.url and server.client().ping()
    finally:
        if server:
            server.stop()
    assert demo._redis(redis_server.url, tmp_path / "r2") == (redis_server.url, None)
    with pytest.raises(demo.DemoRedisError, match="FLEET_REDIS_URL is set"):
        demo._redis(f"redis://:pw@127.0.0.1:{free_port()}/0", tmp_path / "r3")


def test_demo_main_ends_on_a_silent_fleet_redis_url(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FLEET_REDIS_URL", f"redis://:secret-pw@127.0.0.1:{free_port()}/0")
    assert demo.main() == 4
    err = capsys.readouterr().err
    assert "does not answer" in err and "secret-pw" not in err
