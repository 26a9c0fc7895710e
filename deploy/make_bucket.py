"""Create the bucket of ``FLEET_STORE_URL`` (``s3://bucket/prefix``) if it does not exist.

Run once at start by the compose service ``createbucket`` (MinIO), or by hand against any
S3-compatible store. Idempotent; waits up to ``--wait-s`` for the endpoint to answer.
Credentials come from the standard AWS environment, the endpoint from
``FLEET_S3_ENDPOINT_URL``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from urllib.parse import urlparse

from config.settings import load_settings


class BucketError(RuntimeError):
    """The bucket could not be created or checked."""


def bucket_of(store_url: str) -> str:
    """Bucket name of an ``s3://bucket/prefix`` store URL."""
    parsed = urlparse(store_url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise BucketError(f"FLEET_STORE_URL {store_url!r} is not s3://bucket/prefix")
    return parsed.netloc


def _code(exc: Exception) -> str:
    """The S3 error code of a botocore ClientError."""
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def ensure_bucket(bucket: str, endpoint_url: str | None, region: str | None,
                  wait_s: float) -> bool:
    """Create ``bucket`` unless it exists; True if it was created."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = boto3.client("s3", endpoint_url=endpoint_url, region_name=region)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            s3.head_bucket(Bucket=bucket)
            return False
        except ClientError as exc:
            if _code(exc) in ("404", "NoSuchBucket"):
                break
            if not _code(exc).startswith("5") or time.monotonic() > deadline:
                raise BucketError(f"cannot check bucket {bucket}: {exc}") from exc
        except BotoCoreError as exc:  # the endpoint is not up yet
            if time.monotonic() > deadline:
                raise BucketError(f"S3 endpoint {endpoint_url} not answering: {exc}") from exc
        time.sleep(1.0)
    extra = ({"CreateBucketConfiguration": {"LocationConstraint": region}}
             if region and region != "us-east-1" else {})
    try:
        s3.create_bucket(Bucket=bucket, **extra)
    except (ClientError, BotoCoreError) as exc:
        raise BucketError(f"cannot create bucket {bucket}: {exc}") from exc
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 when the bucket exists afterwards."""
    p = argparse.ArgumentParser(prog="python -m deploy.make_bucket",
                                description=__doc__.splitlines()[0])
    p.add_argument("--wait-s", type=float, default=60.0, help="how long to wait for the endpoint")
    ns = p.parse_args(argv)
    settings = load_settings()
    try:
        bucket = bucket_of(settings.store_url)
        created = ensure_bucket(bucket, settings.s3.endpoint_url, settings.s3.region, ns.wait_s)
    except BucketError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"bucket {bucket} {'created' if created else 'already exists'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
