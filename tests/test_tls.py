"""rediss:// end to end against a real TLS redis-server: certificate checked by default, a
password with URL characters quoted; the store location says when S3 travels in clear."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import orjson
import pytest
import redis
from kombu import Connection

from config.settings import Settings
from producer.localfleet import free_port, stop_process
from tests.conftest import run_producer
from workers.dataset.location import locate

PASSWORD = "tls/pw#x?y=1"


def _cert(folder: Path) -> tuple[Path, Path]:
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    return key, cert


@pytest.fixture()
def tls_redis(tmp_path: Path):
    """A redis-server answering TLS only, with PASSWORD; yields (port, CA file)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = _cert(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
         "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients",
         "no", "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path), "--requirepass",
         PASSWORD], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, ssl=True,
                         ssl_ca_certs=str(cert))
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, "TLS redis did not start"
            time.sleep(0.05)
    yield port, cert
    stop_process(proc, grace_s=5)


def test_rediss_url_checks_the_certificate_and_quotes_the_password(tls_redis, fleet_env):
    port, cert = tls_redis
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    settings = Settings(redis_url=url, redis_password=PASSWORD)
    full = settings.redis_url.get_secret_value()
    assert "ssl_cert_reqs=required" in full and PASSWORD not in full
    assert redis.Redis.from_url(full).ping()
    with Connection(full) as conn:  # Celery's broker connection (kombu)
        conn.ensure_connection(max_retries=1)
    res = run_producer({**fleet_env, "FLEET_REDIS_URL": url, "REDIS_PASSWORD": PASSWORD},
                       "jobs", "--json")
    assert res.returncode == 0 and orjson.loads(res.stdout) == [], res.stderr
    # Without the CA the certificate is refused (verification is on by default).
    bare = Settings(redis_url=f"rediss://127.0.0.1:{port}/0", redis_password=PASSWORD)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(bare.redis_url.get_secret_value()).ping()


def test_store_location_says_when_s3_travels_in_clear():
    assert locate("s3://b/p", "http://10.0.0.5:9000").tls is False
    assert "plain HTTP" in locate("s3://b/p", "http://10.0.0.5:9000").why
    assert locate("s3://b/p", "https://minio.internal:9000").tls is True
    assert locate("s3://b/p", None).tls is True
