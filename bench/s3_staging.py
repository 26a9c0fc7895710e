"""Finding 2: staging 1M prompts of 1 KB into S3 with a real per-request latency, <= 60 s.

moto's standalone server (``python -m moto.server``, the S3 the tests use) stands for S3, behind
a TCP proxy (:class:`tests.tcpproxy.TcpProxy`) that holds every chunk the server sends back by
``--latency-ms`` (20 by default), so each request (PUT, HEAD, GET) pays at least that round
trip, as against a real bucket. ``python -m producer enqueue`` is timed as a user runs it
(process start, read, fingerprint, gzip, PUTs, job record, messages), with the store URL
``s3://bench/runs`` and the endpoint at the proxy. The same file is also staged into a local
folder in the same run, so the S3 figure can be read against the local one on this machine.
Then the first ``--compare-prompts`` prompts are staged in-process through the same proxy twice,
with one PUT at a time (the writer before issue 14) and with PARALLEL_PUTS: the writer's own
gain, in one run.

    python -m bench.s3_staging [--prompts 1000000] [--latency-ms 20] [--compare-prompts 100000]
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import Goal, local_fleet, note, verdict, write_chat_prompts
from producer.enqueue import PARALLEL_PUTS, BatchWriter, EnqueueReport, stage
from producer.localfleet import free_port
from producer.readers import read_rows
from tests.tcpproxy import TcpProxy
from workers.dataset.jobs import JobSpec
from workers.dataset.store import open_store

GOAL_S = 60.0
PROMPT_BYTES = 1024
AWS_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def moto_server(log_path: str) -> Iterator[int]:
    """moto's S3 server on a free port, stopped afterwards; yields its port."""
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                 str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **AWS_ENV}, start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while True:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start (see {log_path})")
                time.sleep(0.1)
            yield port
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)


def staging_s(store_url: str, path: Path, rows: int, parallel: int) -> float:
    """Seconds to stage the first ``rows`` prompts of ``path`` with ``parallel`` PUTs."""
    store = open_store(store_url)
    spec = JobSpec(name="cmp", total=0, batch_size=500, n_batches=0, input_path=str(path),
                   input_fingerprint="")
    t0 = time.monotonic()
    stage(store, f"cmp{parallel}", itertools.islice(read_rows(path), rows), 500,
          EnqueueReport(spec=spec, created=True), skip_existing=False,
          writer=BatchWriter(store, parallel=parallel))
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 when the goal is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompts", type=int, default=1_000_000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--compare-prompts", type=int, default=100_000)
    args = parser.parse_args(argv)
    import boto3

    with local_fleet("s3-staging") as fleet, \
            moto_server(str(fleet.workdir / "moto.log")) as port:
        path = write_chat_prompts(fleet.workdir / "prompts.jsonl", args.prompts, PROMPT_BYTES)
        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}",
                     **{k.lower(): v for k, v in AWS_ENV.items() if k != "AWS_DEFAULT_REGION"},
                     region_name="us-east-1").create_bucket(Bucket="bench")
        proxy = TcpProxy(port, args.latency_ms / 1000)
        t0 = time.monotonic()
        fleet.producer("enqueue", str(path), "--job", "local")
        local_s = time.monotonic() - t0
        note(f"enqueue into the local folder: {local_s:.1f} s")
        fleet.base_env.update({**AWS_ENV, "FLEET_STORE_URL": "s3://bench/runs",
                               "FLEET_S3_ENDPOINT_URL": proxy.url})
        t0 = time.monotonic()
        res = fleet.producer("enqueue", str(path), "--job", "s3")
        s3_s = time.monotonic() - t0
        note(f"enqueue into S3 (moto + {args.latency_ms:.0f} ms per response, "
             f"{PARALLEL_PUTS} PUTs in flight): {s3_s:.1f} s; "
             f"{res.stderr.strip().splitlines()[-1]}; S3 / local folder x{s3_s / local_s:.2f} "
             "(the local figure says how loaded the machine is)")
        if args.compare_prompts:
            os.environ.update({**AWS_ENV, "FLEET_S3_ENDPOINT_URL": proxy.url})
            n = min(args.compare_prompts, args.prompts)
            one = staging_s("s3://bench/cmp", path, n, 1)
            many = staging_s("s3://bench/cmp", path, n, PARALLEL_PUTS)
            note(f"staging {n:,} prompts in-process through the proxy: one PUT at a time "
                 f"{one:.1f} s, {PARALLEL_PUTS} at a time {many:.1f} s (x{one / many:.2f})")
        proxy.down()
    return verdict("bench.s3_staging (finding 2)", [
        Goal(f"enqueue of {args.prompts:,} prompts of 1 KB into S3 "
             f"(+{args.latency_ms:.0f} ms/request)", s3_s, GOAL_S, "s", at_most=True),
        Goal("  the same into a local folder (for reference)", local_s, GOAL_S, "s",
             at_most=True),
    ])


if __name__ == "__main__":
    sys.exit(main())
