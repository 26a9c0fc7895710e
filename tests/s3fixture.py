"""A real S3 endpoint for tests: moto's standalone server as a subprocess on a free port.

tests/conftest.py loads it for every module (fixtures
``moto_server`` and ``s3_env``); nothing patches boto3 in-process, so every store call goes
over HTTP as it would to AWS.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from producer.localfleet import free_port

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class MotoServer:
    """A running ``moto.server`` bound to 127.0.0.1."""

    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        """Endpoint URL (FLEET_S3_ENDPOINT_URL)."""
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> Any:
        """A boto3 S3 client of this server."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"moto server not listening on {port} after {timeout_s} s")


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """moto's S3 server for the whole session (``python -m moto.server -H 127.0.0.1``)."""
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **AWS_ENV},
        start_new_session=True,
    )
    try:
        _wait_port(port, proc, timeout_s=30)
        yield MotoServer(port, proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        log.close()


@pytest.fixture()
def s3_env(
    fleet_env: dict[str, str], moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """``fleet_env`` pointed at a fresh bucket (s3://bucket/prefix); also set in os.environ."""
    bucket = f"fleet-{uuid.uuid4().hex[:12]}"
    moto_server.client().create_bucket(Bucket=bucket)
    env = {
        **fleet_env,
        **AWS_ENV,
        "FLEET_STORE_URL": f"s3://{bucket}/runs",
        "FLEET_S3_ENDPOINT_URL": moto_server.url,
    }
    for key, value in env.items():
        if key.startswith(("FLEET_", "AWS_")):
            monkeypatch.setenv(key, value)
    return env
