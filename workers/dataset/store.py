"""The object store: one small interface, a local folder (default) and S3 through boto3.

Keys are relative, ``/``-separated paths (``jobs/<job>/results/b000012.jsonl``). Writes are
write-then-commit: a reader never sees half an object (a rename locally; S3 makes an object
visible only when its upload completes). Errors from the OS, botocore, boto3 and s3transfer
become StoreError here; an access denial becomes StoreDenied, which is never retried.

What a killed writer leaves behind (a local ``.tmp-*`` file, an S3 multipart upload whose parts
are billed but invisible) is removed by :meth:`Store.clean_partial`, which the sink calls at its
start. On S3, add a lifecycle rule as well (docs/output.md, "S3"): it also covers the other writers.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar
from urllib.parse import unquote, urlparse

from config.settings import S3Settings, Settings
from workers.errors import StoreError
from workers.retry import RetryPolicy, backoff_s

log = logging.getLogger(__name__)
T = TypeVar("T")
# Objects are readable by other users (a host reading what a container wrote), as a plain
# open() with the usual umask 022 would make them; mkstemp alone makes them 0600.
FILE_MODE = 0o644
TMP_PREFIX = ".tmp-"


class ObjectMissing(StoreError):
    """The key does not exist in the store."""


class StoreDenied(StoreError):
    """The store refused access (HTTP 403): retrying does not help, so nothing retries it."""


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename or a new entry in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Store(Protocol):
    """What the fleet needs from an object store."""

    url: str

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` under ``key`` atomically (replacing any old object)."""

    def put_stream(self, key: str, src: BinaryIO) -> None:
        """Write what ``src`` yields under ``key`` atomically; nothing appears if it fails."""

    def get(self, key: str) -> bytes:
        """Read the object at ``key``; raise ObjectMissing when absent."""

    def get_into(self, key: str, dst: BinaryIO) -> None:
        """Copy the object at ``key`` into ``dst``; raise ObjectMissing when absent."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under ``prefix``, in lexical order."""

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error when absent)."""

    def clean_partial(self, prefix: str, older_than_s: float = 0.0) -> int:
        """Remove what killed writers left under ``prefix`` (temporary files, unfinished
        multipart uploads) started at least ``older_than_s`` ago; return how many."""


class LocalStore:
    """A folder on the local disk (``file:///abs/path``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = root.as_uri()

    def __repr__(self) -> str:
        return f"<LocalStore {self.root}>"

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise StoreError(f"key {key!r} escapes the store root")
        return path

    def put(self, key: str, data: bytes) -> None:
        """Write to a temporary file beside the target, fsync, then rename over it."""
        self.put_stream(key, io.BytesIO(data))

    def put_stream(self, key: str, src: BinaryIO) -> None:
        """Copy ``src`` to a temporary file, fsync, rename; the temporary goes on failure."""
        path = self._path(key)
        tmp = None
        try:
            new_dir = not path.parent.is_dir()
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX)
            with os.fdopen(fd, "wb") as fh:
                shutil.copyfileobj(src, fh, 8 * 2**20)
                fh.flush()
                os.fchmod(fh.fileno(), FILE_MODE)
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            tmp = None
            fsync_dir(path.parent)  # the rename itself is durable only once its folder is
            if new_dir:
                fsync_dir(path.parent.parent)
        except OSError as exc:
            raise StoreError(f"cannot write {path}: {exc}") from exc
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def get(self, key: str) -> bytes:
        """Read a whole object."""
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as exc:
            raise ObjectMissing(key) from exc
        except OSError as exc:
            raise StoreError(f"cannot read {key}: {exc}") from exc

    def get_into(self, key: str, dst: BinaryIO) -> None:
        """Copy an object into ``dst`` in chunks."""
        try:
            with self._path(key).open("rb") as fh:
                shutil.copyfileobj(fh, dst, 8 * 2**20)
        except FileNotFoundError as exc:
            raise ObjectMissing(key) from exc
        except OSError as exc:
            raise StoreError(f"cannot read {key}: {exc}") from exc

    def exists(self, key: str) -> bool:
        """Whether the object exists."""
        return self._path(key).is_file()

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under a folder-like prefix (temporary files excluded)."""
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return iter(())
        keys = (
            p.relative_to(self.root).as_posix()
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(TMP_PREFIX)
        )
        return iter(sorted(keys))

    def delete(self, key: str) -> None:
        """Remove an object if present."""
        self._path(key).unlink(missing_ok=True)

    def clean_partial(self, prefix: str, older_than_s: float = 0.0) -> int:
        """Remove ``.tmp-*`` files under ``prefix`` last written ``older_than_s`` ago or more."""
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return 0
        cutoff, n = time.time() - older_than_s, 0
        for p in base.rglob(f"{TMP_PREFIX}*"):
            with contextlib.suppress(FileNotFoundError):
                if p.is_file() and p.stat().st_mtime <= cutoff:
                    p.unlink()
                    n += 1
        return n


class S3Store:
    """An S3 bucket and prefix (``s3://bucket/prefix``) through boto3's managed transfers."""

    def __init__(self, bucket: str, prefix: str, s3: S3Settings) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint_url = s3.endpoint_url
        self._client = boto3.client(
            "s3",
            endpoint_url=s3.endpoint_url,
            region_name=s3.region,
            # Few quick retries here; longer outages are the fleet's retry policy (settings).
            config=Config(retries={"max_attempts": 3, "mode": "standard"}),
        )
        self._transfer = TransferConfig(multipart_threshold=s3.multipart_threshold_bytes,
                                        multipart_chunksize=s3.multipart_chunk_bytes)

    def __repr__(self) -> str:
        return f"<S3Store {self.url}>"

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        """Upload (multipart above the threshold); the object appears only when complete."""
        self.put_stream(key, io.BytesIO(data))

    def put_stream(self, key: str, src: BinaryIO) -> None:
        """Managed upload of ``src``; a failed multipart upload is aborted, so nothing shows."""
        with _boto_errors("write", key):
            self._client.upload_fileobj(src, self.bucket, self._key(key), Config=self._transfer)

    def get(self, key: str) -> bytes:
        """Download a whole object."""
        with _boto_errors("read", key):
            obj = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            return obj["Body"].read()

    def get_into(self, key: str, dst: BinaryIO) -> None:
        """Managed (ranged, parallel) download of an object into ``dst``."""
        with _boto_errors("read", key):
            self._client.download_fileobj(self.bucket, self._key(key), dst,
                                          Config=self._transfer)

    def exists(self, key: str) -> bool:
        """Whether the object exists (HEAD)."""
        try:
            with _boto_errors("stat", key):
                self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ObjectMissing:
            return False
        return True

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under ``prefix``, paginated."""
        strip = len(self.prefix) + 1 if self.prefix else 0
        with _boto_errors("list", prefix):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix)
            )
            keys = [o["Key"][strip:] for page in pages for o in page.get("Contents", [])]
        return iter(sorted(keys))

    def delete(self, key: str) -> None:
        """Delete an object."""
        with _boto_errors("delete", key):
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def clean_partial(self, prefix: str, older_than_s: float = 0.0) -> int:
        """Abort the multipart uploads under ``prefix`` initiated ``older_than_s`` ago or more
        (a killed process leaves their parts stored and billed, but never visible)."""
        cutoff, n = time.time() - older_than_s, 0
        with _boto_errors("list uploads under", prefix):
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix))
            stale = [u for page in pages for u in page.get("Uploads", [])
                     if u["Initiated"].timestamp() <= cutoff]
        for upload in stale:
            with _boto_errors("abort upload of", upload["Key"]):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                    UploadId=upload["UploadId"])
            n += 1
        return n


@contextlib.contextmanager
def _boto_errors(verb: str, key: str) -> Iterator[None]:
    """Translate errors at the boundary: a missing key -> ObjectMissing, a 403 -> StoreDenied,
    anything else from botocore, boto3's and s3transfer's managed transfers (which raise their
    own classes, e.g. s3transfer's RetriesExceededError for a download cut off too often) or
    the OS -> StoreError (retried by the caller's policy)."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError
    from s3transfer import exceptions as transfer

    try:
        yield
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        if code in ("NoSuchKey", "404", "NotFound"):
            raise ObjectMissing(key) from exc
        if code in ("403", "AccessDenied", "Forbidden"):
            raise StoreDenied(f"cannot {verb} {key}: access denied ({code}); the credentials "
                              "need s3:GetObject, s3:PutObject, s3:DeleteObject and "
                              "s3:ListBucket (without it a missing key is a 403 too)") from exc
        raise StoreError(f"cannot {verb} {key}: {exc}") from exc
    except (BotoCoreError, Boto3Error, transfer.RetriesExceededError,
            transfer.S3DownloadFailedError, transfer.S3UploadFailedError, OSError) as exc:
        raise StoreError(f"cannot {verb} {key}: {type(exc).__name__}: {exc}") from exc


def store_policy(settings: Settings) -> RetryPolicy:
    """The fleet's retry policy for store calls (FLEET_STORE_RETRY_*): ~2.5 min by default."""
    return RetryPolicy(settings.store_retry_attempts, 1.0, settings.store_retry_max_s)


class RetryingStore:
    """A store whose calls are retried with backoff on StoreError (never on ObjectMissing or
    StoreDenied)."""

    def __init__(self, inner: Store, policy: RetryPolicy,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.inner, self.policy, self._sleep = inner, policy, sleep
        self.url = inner.url
        self.endpoint_url: str | None = getattr(inner, "endpoint_url", None)

    def __repr__(self) -> str:
        return f"<RetryingStore {self.inner!r} attempts={self.policy.max_attempts}>"

    def _call(self, what: str, op: Callable[[], T], rewind: Callable[[], None] | None = None
              ) -> T:
        for attempt in range(1, self.policy.max_attempts + 1):
            try:
                return op()
            except (ObjectMissing, StoreDenied):
                raise
            except StoreError as exc:
                if attempt == self.policy.max_attempts:
                    raise
                delay = backoff_s(attempt, self.policy)
                log.warning("store %s failed (%s); retry in %.1f s", what, exc, delay)
                self._sleep(delay)
                if rewind:
                    rewind()
        raise AssertionError("unreachable")

    def put(self, key: str, data: bytes) -> None:
        """Write, retried."""
        self._call(f"put {key}", lambda: self.inner.put(key, data))

    def put_stream(self, key: str, src: BinaryIO) -> None:
        """Upload a seekable stream, retried from where it started."""
        start = src.tell()

        def rewind() -> None:
            src.seek(start)

        self._call(f"put {key}", lambda: self.inner.put_stream(key, src), rewind)

    def get(self, key: str) -> bytes:
        """Read, retried."""
        return self._call(f"get {key}", lambda: self.inner.get(key))

    def get_into(self, key: str, dst: BinaryIO) -> None:
        """Download into a seekable stream, retried (a partial copy is cut off first)."""
        start = dst.tell()

        def rewind() -> None:
            dst.seek(start)
            dst.truncate()

        self._call(f"get {key}", lambda: self.inner.get_into(key, dst), rewind)

    def exists(self, key: str) -> bool:
        """HEAD, retried."""
        return self._call(f"stat {key}", lambda: self.inner.exists(key))

    def list(self, prefix: str) -> Iterator[str]:
        """List, retried (the whole listing is read before it is returned)."""
        return iter(self._call(f"list {prefix}", lambda: list(self.inner.list(prefix))))

    def delete(self, key: str) -> None:
        """Delete, retried."""
        self._call(f"delete {key}", lambda: self.inner.delete(key))

    def clean_partial(self, prefix: str, older_than_s: float = 0.0) -> int:
        """Remove what killed writers left, retried."""
        return self._call(f"clean {prefix}",
                          lambda: self.inner.clean_partial(prefix, older_than_s))


def open_store(url: str, s3: S3Settings | None = None) -> Store:
    """Open the store named by ``url`` (``file:///path`` or ``s3://bucket/prefix``)."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        root = Path(unquote(parsed.netloc + parsed.path))
        return LocalStore(root if root.is_absolute() else Path.cwd() / root)
    if parsed.scheme == "s3":
        return S3Store(parsed.netloc, parsed.path, s3 or S3Settings())
    if not parsed.scheme:
        return LocalStore(Path(url).resolve())
    raise StoreError(f"unsupported store URL {url!r} (use file:///path or s3://bucket/prefix)")
