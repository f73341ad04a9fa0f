"""One storage layer for what must outlive a machine: `s3://bucket/prefix` URLs and local folders, put/get/list."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from geofed_hpc.ckpt.atomic import PRIVATE_FILE, atomic_write_bytes
from geofed_hpc.errors import ConfigError, StoreError
from geofed_hpc.faults import fault

# The client library is obstore (Rust's object_store), picked over fsspec+s3fs by measurement on the same
# S3-protocol server (bench/object_store.py --compare, 256 MB on 2 busy cores): a snapshot's upload 41 vs 26 MB/s,
# its download 300 vs 45 MB/s, a 256 KiB journal put 2.8 vs 4.1 ms; it takes retries and backoff as timedeltas and
# needs no event loop of ours. boto3 only supplies credentials from the standard chain (obstore.auth.boto3).
SCHEMES = ("s3://",)
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # the standard AWS variables, for S3-compatible stores
CHUNK = 8 << 20  # bytes per part of an upload (S3's multipart minimum is 5 MiB)
EXTRA = "pip install 'geofed-hpc[s3]'"


@dataclass(frozen=True)
class Retry:
    """How a failed request is tried again: up to `attempts` times, waiting `first`, then twice as long each time
    up to `longest`, and never past `total` in all (the PS waits under its lock: a store that stays down fails the
    push, which the site sends again, rather than holding every call for minutes)."""

    attempts: int = 5
    first: timedelta = timedelta(milliseconds=200)
    longest: timedelta = timedelta(seconds=5)
    total: timedelta = timedelta(seconds=30)


def is_remote(url: str) -> bool:
    """`url` names an object store (s3://...), not a local folder (a path, or file://)."""
    return url.startswith(SCHEMES)


def local_path(url: str) -> Path:
    """A plain path or a file:// URL as a Path."""
    return Path(url.removeprefix("file://")).expanduser()


class Store(Protocol):
    """Objects under one root (`url`): keys are '/'-separated names below it. A put is whole or absent (a reader
    never sees half an object); each error is a StoreError (an OSError too) naming the object's URL."""

    url: str

    def where(self, key: str) -> str: ...
    def put(self, key: str, data: bytes | Iterator[bytes]) -> None: ...
    def get(self, key: str) -> bytes: ...
    def get_file(self, key: str, path: Path) -> int: ...
    def listing(self, prefix: str = "") -> dict[str, int]: ...
    def tagged(self, prefix: str = "") -> dict[str, tuple[int, str]]: ...
    def chunks(self, key: str) -> Iterator[bytes]: ...
    def delete(self, key: str) -> None: ...


def open_store(url: str, retry: Retry | None = None, setting: str = "url") -> Store:
    """The store `url` names: an S3Store for s3://bucket/prefix, else a LocalStore for a folder. `setting` names the
    config key the URL came from, in errors."""
    if is_remote(url):
        return S3Store(url, retry or Retry(), setting)
    return LocalStore(local_path(url))


def file_chunks(path: Path, size: int = CHUNK) -> Iterator[bytes]:
    """A file's bytes in chunks (an upload streams a large snapshot instead of holding it)."""
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk


class LocalStore:
    """A folder as a store: objects are files (mode 0600), each written atomically."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def where(self, key: str) -> str:
        return str(self.root / key)

    def put(self, key: str, data: bytes | Iterator[bytes]) -> None:
        fault("store.put", key)
        atomic_write_bytes(self.root / key, data, mode=PRIVATE_FILE)

    def get(self, key: str) -> bytes:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            raise StoreError(f"{self.where(key)}: no such object", missing=True) from None

    def get_file(self, key: str, path: Path) -> int:
        data = self.get(key)
        atomic_write_bytes(path, data, mode=PRIVATE_FILE)
        return len(data)

    def listing(self, prefix: str = "") -> dict[str, int]:
        out: dict[str, int] = {}
        for folder, _, names in os.walk(self.root):
            for name in names:
                key = (Path(folder) / name).relative_to(self.root).as_posix()
                if key.startswith(prefix) and not name.startswith("."):
                    out[key] = (Path(folder) / name).stat().st_size
        return out

    def tagged(self, prefix: str = "") -> dict[str, tuple[int, str]]:
        """(size, a tag that changes when the object is replaced: its mtime) of each object under `prefix`."""
        return {k: (n, str((self.root / k).stat().st_mtime_ns)) for k, n in self.listing(prefix).items()}

    def chunks(self, key: str) -> Iterator[bytes]:
        try:
            yield from file_chunks(self.root / key)
        except FileNotFoundError:
            raise StoreError(f"{self.where(key)}: no such object", missing=True) from None

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / key).unlink()


class S3Store:
    """An S3 bucket (or any S3-compatible store: MinIO, Ceph RGW, R2, Wasabi) under `s3://bucket/prefix`.

    Credentials come from the standard places through botocore's chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY,
    AWS_PROFILE and ~/.aws, web identity, instance roles); the endpoint of an S3-compatible store from the standard
    AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3); the region from AWS_REGION or ~/.aws/config. No secret is ever
    logged or put in an error."""

    def __init__(self, url: str, retry: Retry, setting: str = "url") -> None:
        try:
            import boto3
            import obstore
            from obstore.auth.boto3 import Boto3CredentialProvider
            from obstore.store import S3Store as _S3
        except ImportError:
            raise ConfigError(f"{setting}: {url} needs the s3 extra: {EXTRA}") from None
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise ConfigError(f"{setting}: {url!r} names no bucket; write s3://BUCKET/PREFIX")
        self.url = url.rstrip("/")
        self._ob = obstore
        session = boto3.Session()
        if session.get_credentials() is None:
            raise StoreError(
                f"{self.url}: no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                "AWS_PROFILE (~/.aws/credentials), or run on an instance with a role"
            )
        endpoint = next((os.environ[k] for k in ENDPOINT_ENV if os.environ.get(k)), "")
        options: dict[str, Any] = {}
        if endpoint:
            options.update(endpoint=endpoint, client_options={"allow_http": endpoint.startswith("http://")})
        if not session.region_name:
            options["region"] = "us-east-1"
        backoff = {"init_backoff": retry.first, "max_backoff": retry.longest, "base": 2}
        retries: Any = {"max_retries": retry.attempts, "backoff": backoff, "retry_timeout": retry.total}
        self._store = _S3(
            bucket,
            prefix=prefix.strip("/") or None,
            credential_provider=Boto3CredentialProvider(session),
            retry_config=retries,
            **options,
        )

    def where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def put(self, key: str, data: bytes | Iterator[bytes]) -> None:
        fault("store.put", key)
        body = data if isinstance(data, bytes) else self._chunks(key, data)
        with self._errors(key, "write"):
            self._ob.put(self._store, key, body, chunk_size=CHUNK, max_concurrency=4)

    def _chunks(self, key: str, data: Iterator[bytes]) -> Iterator[bytes]:
        for chunk in data:
            yield chunk
            fault("store.chunk", key)  # a writer killed mid-upload: S3 shows no object until the last part

    def get(self, key: str) -> bytes:
        with self._errors(key, "read"):
            return bytes(self._ob.get(self._store, key).bytes())

    def get_file(self, key: str, path: Path) -> int:
        with self._errors(key, "read"):
            stream = self._ob.get(self._store, key).stream(min_chunk_size=CHUNK)
            atomic_write_bytes(path, (bytes(chunk) for chunk in stream), mode=PRIVATE_FILE)
        return path.stat().st_size

    def listing(self, prefix: str = "") -> dict[str, int]:
        out: dict[str, int] = {}
        with self._errors(prefix, "list"):
            for batch in self._ob.list(self._store, prefix or None):
                out.update({str(meta["path"]): int(meta["size"]) for meta in batch})
        return out

    def tagged(self, prefix: str = "") -> dict[str, tuple[int, str]]:
        """(size, ETag) of each object under `prefix`: the tag changes when an object is replaced."""
        out: dict[str, tuple[int, str]] = {}
        with self._errors(prefix, "list"):
            for batch in self._ob.list(self._store, prefix or None):
                out.update({str(meta["path"]): (int(meta["size"]), str(meta.get("e_tag") or "")) for meta in batch})
        return out

    def chunks(self, key: str) -> Iterator[bytes]:
        """An object's bytes as a stream of chunks (a large object is never held whole)."""
        with self._errors(key, "read"):
            for chunk in self._ob.get(self._store, key).stream(min_chunk_size=CHUNK):
                yield bytes(chunk)

    def delete(self, key: str) -> None:
        with self._errors(key, "delete"):
            self._ob.delete(self._store, key)  # a missing object is no error in S3

    @contextlib.contextmanager
    def _errors(self, key: str, verb: str) -> Iterator[None]:
        """obstore's errors as one StoreError line: the object's URL and what to do."""
        from obstore import exceptions as ex

        where = self.where(key)
        bucket = self.url[len("s3://") :].split("/")[0]
        try:
            yield
        except StoreError:
            raise
        except (FileNotFoundError, PermissionError, ex.BaseError, ConnectionError, TimeoutError) as exc:
            # obstore raises Python's FileNotFoundError for a 404, its own classes for the rest
            text = str(exc)
            if "NoSuchBucket" in text:
                fix = f"the bucket {bucket} does not exist: create it (aws s3 mb s3://{bucket}) or fix the URL"
            elif isinstance(exc, (FileNotFoundError, ex.NotFoundError)):
                raise StoreError(f"{where}: no such object", missing=True) from None
            elif isinstance(exc, (PermissionError, ex.PermissionDeniedError, ex.UnauthenticatedError)):
                fix = f"the store refused the credentials; check that they may {verb} in this bucket"
            elif "QuotaExceeded" in text or "EntityTooLarge" in text:
                fix = "the store refuses writes (quota): free space in the bucket or raise its quota"
            else:
                fix = f"{_first_line(text)}; check the endpoint (AWS_ENDPOINT_URL) and the network, then try again"
            raise StoreError(f"cannot {verb} {where}: {fix}") from None


def _first_line(text: str, limit: int = 200) -> str:
    """The first meaningful line of a library error (never credentials: obstore does not print them)."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "unknown error")
    return line[:limit]
