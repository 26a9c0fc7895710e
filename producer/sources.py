"""Where a prompt data set lives: a local file or folder, ``s3://bucket/key`` (one object or a
prefix of parts), or any other fsspec URL whose filesystem package is installed.

A folder or prefix is read as its parts (``.jsonl``, ``.jsonl.gz``, ``.json``, ``.ndjson``,
``.parquet``) in name order; other objects in it (``_SUCCESS``, ``.crc``) are skipped. S3 goes
through boto3 with the store's settings (``FLEET_S3_ENDPOINT_URL``, ``FLEET_S3_REGION``,
credentials from the standard AWS environment), streamed: JSONL as one GET, Parquet by ranged
GETs (its footer, then the column chunks).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

from config.settings import S3Settings
from workers.errors import InputError

PART_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
                 ".jsonl.gz": "jsonl.gz", ".json.gz": "jsonl.gz", ".ndjson.gz": "jsonl.gz"}
READ_BUFFER_BYTES = 8 * 2**20  # one ranged GET per 8 MiB of a Parquet part


def part_format(name: str) -> str | None:
    """``jsonl``, ``jsonl.gz`` or ``parquet`` by the name's suffix (None: not a part)."""
    lower = name.lower()
    for suffix in sorted(PART_SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix):
            return PART_SUFFIXES[suffix]
    return None


@dataclass(frozen=True)
class Part:
    """One file of a data set: its name in errors, its format and how to open it (binary,
    seekable for Parquet)."""

    name: str
    fmt: str
    open: Callable[[], IO[bytes]]


def _only_parts(url: str, names: list[tuple[str, Callable[[], IO[bytes]]]]) -> list[Part]:
    parts = [Part(n, f, o) for n, o in sorted(names, key=lambda x: x[0])
             if (f := part_format(n)) is not None]
    if not parts:
        raise InputError(url, None, "no .jsonl[.gz] or .parquet parts found")
    return parts


def _single(url: str, name: str, opener: Callable[[], IO[bytes]]) -> list[Part]:
    fmt = part_format(name)
    if fmt is None:
        raise InputError(url, None, "unsupported format (use .jsonl, .jsonl.gz or .parquet)")
    return [Part(url, fmt, opener)]


def _local(url: str) -> list[Part]:
    path = Path(url.removeprefix("file://"))
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file()]
        return _only_parts(url, [(str(p), (lambda p=p: p.open("rb"))) for p in files])
    if not path.exists():
        raise InputError(url, None, "no such file")
    return _single(url, path.name, lambda: path.open("rb"))


class S3Object(io.RawIOBase):
    """A seekable read-only view of one S3 object through ranged GETs."""

    def __init__(self, client: Any, bucket: str, key: str, size: int) -> None:
        self._client, self._bucket, self._key, self._size = client, bucket, key, size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: Any) -> int:
        if self._pos >= self._size or not len(buf):
            return 0
        end = min(self._pos + len(buf), self._size) - 1
        data = self._client.get_object(Bucket=self._bucket, Key=self._key,
                                       Range=f"bytes={self._pos}-{end}")["Body"].read()
        buf[: len(data)] = data
        self._pos += len(data)
        return len(data)


@contextmanager
def _s3_errors(url: str) -> Iterator[None]:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (BotoCoreError, ClientError) as exc:
        raise InputError(url, None, f"cannot read from S3: {exc}") from exc


def _s3_opener(client: Any, bucket: str, key: str, size: int, fmt: str | None
               ) -> Callable[[], IO[bytes]]:
    if fmt == "parquet":
        return lambda: io.BufferedReader(S3Object(client, bucket, key, size), READ_BUFFER_BYTES)
    return lambda: client.get_object(Bucket=bucket, Key=key)["Body"]


def _s3_size(client: Any, bucket: str, key: str) -> int | None:
    """The object's size, or None when there is no such object."""
    from botocore.exceptions import ClientError

    try:
        return client.head_object(Bucket=bucket, Key=key)["ContentLength"]
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
            return None
        raise


def _s3(url: str, s3: S3Settings) -> list[Part]:
    import boto3
    from botocore.config import Config

    parsed = urlparse(url)
    bucket, key = parsed.netloc, parsed.path.lstrip("/")
    client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name=s3.region,
                          config=Config(retries={"max_attempts": 3, "mode": "standard"}))
    with _s3_errors(url):
        fmt = part_format(key)
        size = _s3_size(client, bucket, key) if fmt else None
        if fmt and size is not None:
            return [Part(url, fmt, _s3_opener(client, bucket, key, size, fmt))]
        # A prefix of parts (also one named like a file: Spark writes data.parquet/part-*).
        prefix = f"{key.rstrip('/')}/" if key else ""
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        objs = [(o["Key"], o["Size"]) for page in pages for o in page.get("Contents", [])]
    if fmt and not objs:
        raise InputError(url, None, "no such object")
    return _only_parts(url, [(f"s3://{bucket}/{k}",
                              _s3_opener(client, bucket, k, n, part_format(k)))
                             for k, n in objs])


def _fsspec(url: str) -> list[Part]:
    try:
        import fsspec
    except ImportError as exc:
        raise InputError(url, None, "reading this URL needs fsspec and the package of its "
                                    "filesystem (pip install fsspec ...)") from exc
    try:
        fs, path = fsspec.core.url_to_fs(url)
        if fs.isdir(path):
            scheme = url.split("://", 1)[0]
            return _only_parts(url, [(f"{scheme}://{p.lstrip('/')}",
                                      (lambda p=p: fs.open(p, "rb"))) for p in fs.find(path)])
        if not fs.exists(path):
            raise InputError(url, None, "no such file")
    except (ImportError, ValueError, OSError) as exc:
        raise InputError(url, None, f"cannot open: {exc}") from exc
    return _single(url, path, lambda: fs.open(path, "rb"))


def list_parts(url: str | Path, s3: S3Settings | None = None) -> list[Part]:
    """The parts of the data set at ``url`` (a path, a folder, s3://..., or an fsspec URL)."""
    text = str(url)
    scheme = urlparse(text).scheme if "://" in text else ""
    if scheme in ("", "file"):
        return _local(text)
    if scheme == "s3":
        return _s3(text, s3 or S3Settings())
    return _fsspec(text)
