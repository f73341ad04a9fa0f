"""Corpora and shard folders in an object store: s3:// sources listed and streamed, shards published and fetched."""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from geofed_hpc.ckpt.atomic import atomic_write_bytes
from geofed_hpc.ckpt.objects import Store, file_chunks, open_store
from geofed_hpc.errors import ConfigError, StoreError
from geofed_hpc.log import logger

SETTING = "data.source"
INDEX = "index.json"  # data/shards.py's: a folder (or prefix) holding it is a prepared shard folder
_MAGIC = re.compile(r"[*?[]")


@dataclass(frozen=True)
class RemoteFile:
    """One object of a source: its store (the bucket), key, size and ETag."""

    store: Store = field(compare=False, repr=False)
    key: str
    size: int
    tag: str

    @property
    def url(self) -> str:
        return self.store.where(self.key)

    def open(self) -> IO[bytes]:
        """The object as a buffered binary stream, read chunk by chunk as it is consumed."""
        return io.BufferedReader(_ChunkReader(self.store.chunks(self.key)), buffer_size=1 << 20)

    def download(self, path: Path) -> Path:
        self.store.get_file(self.key, path)
        return path


class _ChunkReader(io.RawIOBase):
    """A raw stream over an iterator of chunks (what io.BufferedReader reads from)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks, self._left, self._pos = chunks, b"", 0

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._left:
            try:
                self._left = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(buffer), len(self._left))
        buffer[:n] = self._left[:n]
        self._left, self._pos = self._left[n:], self._pos + n
        return n


def split_url(url: str) -> tuple[str, str]:
    """s3://bucket/some/key -> ("s3://bucket", "some/key")."""
    bucket, _, key = url[len("s3://") :].partition("/")
    if not bucket:
        raise ConfigError(f"{SETTING}: {url!r} names no bucket; write s3://BUCKET/PREFIX")
    return f"s3://{bucket}", key


def _bucket(url: str) -> tuple[Store, str]:
    root, key = split_url(url)
    return open_store(root, setting=SETTING), key


def _pattern(glob: str) -> re.Pattern[str]:
    """A glob over keys: `*` and `?` within one '/'-separated part, `**` across parts, [...] as a set."""
    out, i = "", 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif glob.startswith("**", i):
            out, i = out + ".*", i + 2
        elif glob[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif glob[i] == "?":
            out, i = out + "[^/]", i + 1
        elif glob[i] == "[" and "]" in glob[i + 1 :]:
            end = glob.index("]", i + 1)
            out, i = out + "[" + glob[i + 1 : end].replace("!", "^", 1) + "]", end + 1
        else:
            out, i = out + re.escape(glob[i]), i + 1
    return re.compile(out + r"\Z")


def remote_files(source: str, supported: Callable[[str], bool]) -> list[RemoteFile]:
    """The objects an s3:// data.source names, in key order: one object, every `supported` one under a prefix, or
    those a glob matches. One line naming the URL when there are none, the bucket is missing or credentials are."""
    try:
        store, key = _bucket(source)
        magic = _MAGIC.search(key)
        if magic:
            base = key[: key.rfind("/", 0, magic.start()) + 1]
            match = _pattern(key)
            listed = store.tagged(base.rstrip("/"))
            picked = {k: v for k, v in listed.items() if match.match(k)}
        else:
            listed = store.tagged(key.rsplit("/", 1)[0] if "/" in key.strip("/") else "")
            picked = {k: v for k, v in listed.items() if k == key}
            if not picked:
                folder = key.rstrip("/") + "/" if key.strip("/") else ""
                picked = {k: v for k, v in store.tagged(folder.rstrip("/")).items() if k.startswith(folder)}
    except StoreError as exc:
        raise ConfigError(f"{SETTING}: {exc}") from None
    if not picked:
        raise ConfigError(
            f"{SETTING}: no object matches {source}: check the bucket and prefix (list them with "
            f"`aws s3 ls {split_url(source)[0]}/{key.split('*')[0]}`)"
        )
    return [RemoteFile(store, k, size, tag) for k, (size, tag) in sorted(picked.items()) if supported(k)]


def is_remote_shard_dir(source: str) -> bool:
    """data.source names a prefix of an object store that holds a prepared shard folder (its index.json)."""
    if not source.startswith("s3://") or _MAGIC.search(source):
        return False
    try:
        store, key = _bucket(source.rstrip("/"))
        return f"{key}/{INDEX}" in store.listing(key) if key else INDEX in store.listing()
    except StoreError as exc:
        raise ConfigError(f"{SETTING}: {exc}") from None


def publish_shards(folder: Path, url: str) -> None:
    """Upload a prepared shard folder to `url`, index.json last: a reader sees the whole folder or none of it
    (an index.json there from before is removed first)."""
    setting = "data.shards_url"
    try:
        store = open_store(url.rstrip("/"), setting=setting)
        store.delete(INDEX)
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.name != INDEX and not path.name.startswith("."):
                store.put(path.name, file_chunks(path))
        store.put(INDEX, (folder / INDEX).read_bytes())
    except StoreError as exc:
        raise ConfigError(f"{setting}: {exc}") from None
    logger.info("data prepare: shards uploaded to %s; train with data.source=%s", url, url)


def fetch_shards(url: str, cache: Path, site: int, sites: int) -> Path:
    """A local copy of the shard folder at `url` holding what site `site` of `sites` reads (index.json, its train
    shards, val.bin), under `cache`; a shard already there with the index's SHA-256 is not fetched again."""
    store, key = _bucket(url.rstrip("/"))
    prefix = f"{key}/" if key else ""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    local = cache / "shards" / f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', url[len('s3://') :]).strip('-')[:80]}-{digest}"
    local.mkdir(parents=True, exist_ok=True)
    try:
        raw = store.get(prefix + INDEX)
        index = json.loads(raw)
        rows = [*index["train"][site::sites], index["val"]]
        for row in rows:
            name, want = str(row["file"]), str(row["sha256"])
            if "/" in name or name.startswith("."):
                raise ConfigError(
                    f"{SETTING}: {store.where(prefix + INDEX)} names a shard {name[:64]!r}; prepare again"
                )
            target = local / name
            if target.is_file() and _sha256(target) == want:
                continue
            store.get_file(prefix + name, target)
            if _sha256(target) != want:
                target.unlink()
                raise ConfigError(f"{SETTING}: {store.where(prefix + name)} fails its sha256 checksum; prepare again")
    except StoreError as exc:
        raise ConfigError(f"{SETTING}: {exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{SETTING}: {store.where(prefix + INDEX)} is malformed ({repr(exc)[:200]}); prepare again"
        ) from None
    atomic_write_bytes(local / INDEX, raw)
    logger.info("site %d of %d: shards of %s fetched into %s", site, sites, url, local)
    return local


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for chunk in file_chunks(path):
        digest.update(chunk)
    return digest.hexdigest()
