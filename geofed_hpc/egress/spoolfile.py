"""The spool's folders and files: one call or answer per file, written atomically, checked whole before use."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import stat
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from geofed_hpc.ckpt.atomic import PRIVATE_FILE, atomic_write_bytes, private_dirs, set_aside
from geofed_hpc.errors import CodecError, ConfigError
from geofed_hpc.paths import os_reason

MAGIC = b"GEOFEDSPOOL\x01"
END = 0xFFFF_FFFF_FFFF_FFFF
MAX_ENVELOPE = 64 * 1024
REQUEST, ANSWER = ".req", ".ans"
ID = re.compile(r"[0-9a-f]{1,20}-[0-9a-f]{16}")


class SpoolCorrupt(CodecError):
    """A spool file is truncated, altered or not a spool file at all."""


def new_id() -> str:
    """A unique, time-ordered file id (names sort in the order requests were made)."""
    return f"{time.time_ns():x}-{secrets.token_hex(8)}"


@dataclass(frozen=True)
class Spool:
    """SPOOL/out (requests, written by sites), SPOOL/in (answers, written by the relay), SPOOL/relay (requests the
    relay has taken), SPOOL/quarantine (files that failed their check, kept for the operator)."""

    root: Path

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def inbox(self) -> Path:
        return self.root / "in"

    @property
    def taken(self) -> Path:
        return self.root / "relay"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def prepare(self, setting: str) -> Spool:
        """Make the folders (0700) and refuse any that other users may write in (requests carry the site's token);
        ConfigError naming `setting` and the folder."""
        for folder in (self.root, self.out, self.inbox, self.taken, self.quarantine):
            try:
                private_dirs(folder)
                mode = os.stat(folder).st_mode
            except OSError as exc:
                raise ConfigError(f"{setting}: cannot use {folder}: {os_reason(exc)}") from None
            if not stat.S_ISDIR(mode):
                raise ConfigError(f"{setting}: {folder} is not a folder")
            if mode & stat.S_IWOTH:
                raise ConfigError(
                    f"{setting}: {folder} is writable by other users (mode {stat.S_IMODE(mode):o}): spool files carry "
                    f"the site's token; `chmod o-w {folder}` (better: chmod 700)"
                )
        return self

    def writable(self, setting: str) -> None:
        """ConfigError naming the folder when a file cannot be made in out/ or in/ (read-only, full, not ours)."""
        for folder in (self.out, self.inbox):
            probe = folder / f".probe-{new_id()}"
            try:
                atomic_write_bytes(probe, b"x", mode=PRIVATE_FILE)
                probe.unlink()
            except OSError as exc:
                raise ConfigError(f"{setting}: cannot write in {folder}: {os_reason(exc)}") from None

    def set_aside(self, path: Path) -> Path:
        return set_aside(path, self.quarantine)


def write(path: Path, envelope: dict[str, Any], frames: Iterable[bytes]) -> None:
    """Write `path` (0600) atomically: a temp file beside it, fsync, rename."""
    atomic_write_bytes(path, _encoded(envelope, frames), mode=PRIVATE_FILE)


def _encoded(envelope: dict[str, Any], frames: Iterable[bytes]) -> Iterator[bytes]:
    hasher = hashlib.sha256()

    def out(data: bytes) -> bytes:
        hasher.update(data)
        return data

    head = json.dumps(envelope, separators=(",", ":")).encode()
    yield out(MAGIC + struct.pack(">I", len(head)) + head)
    for frame in frames:
        yield out(struct.pack(">Q", len(frame)))
        yield out(bytes(frame))
    yield out(struct.pack(">Q", END))
    yield hasher.digest()


class SpoolFile:
    """An open spool file whose checksum matched: its envelope, and its frames read on demand. Close it.

    A file is MAGIC, a JSON envelope (its length first, 4 bytes), frames (each an 8-byte length and a serialized
    message, as gRPC carries it), an end mark, and the sha256 of all before it: a truncated or altered file is told
    apart from a whole one before anything in it is used."""

    def __init__(self, path: Path, max_frame: int) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symbolic link where a spool file should be
                raise SpoolCorrupt(f"{path} is a symbolic link, not a spool file") from None
            raise
        self._file: IO[bytes] = os.fdopen(fd, "rb")
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SpoolCorrupt(f"{path} is not a regular file")
            self.envelope, self._frames = self._check(max_frame)
        except BaseException:
            self._file.close()
            raise

    def _check(self, max_frame: int) -> tuple[dict[str, Any], list[tuple[int, int]]]:
        f, hasher, name = self._file, hashlib.sha256(), self.path.name

        def take(n: int, what: str) -> bytes:
            data = f.read(n)
            if len(data) != n:
                raise SpoolCorrupt(f"{name} is truncated (ends inside {what})")
            hasher.update(data)
            return data

        if take(len(MAGIC), "its first bytes") != MAGIC:
            raise SpoolCorrupt(f"{name} is not a spool file (its first bytes are not {MAGIC[:11].decode()})")
        (size,) = struct.unpack(">I", take(4, "the envelope's length"))
        if size > MAX_ENVELOPE:
            raise SpoolCorrupt(f"{name}: an envelope of {size} bytes, over the limit of {MAX_ENVELOPE}")
        try:
            envelope = json.loads(take(size, "the envelope"))
        except ValueError:
            raise SpoolCorrupt(f"{name}: its envelope is not JSON") from None
        if not isinstance(envelope, dict):
            raise SpoolCorrupt(f"{name}: its envelope is not a JSON object")
        frames: list[tuple[int, int]] = []
        while True:
            (size,) = struct.unpack(">Q", take(8, "a frame's length"))
            if size == END:
                break
            if size > max_frame:
                raise SpoolCorrupt(f"{name}: a frame of {size} bytes, over the limit of {max_frame}")
            frames.append((f.tell(), size))
            left = size
            while left:
                piece = f.read(min(left, 1 << 20))
                if not piece:
                    raise SpoolCorrupt(f"{name} is truncated (ends inside frame {len(frames)})")
                hasher.update(piece)
                left -= len(piece)
        digest = f.read(32)
        if len(digest) != 32:
            raise SpoolCorrupt(f"{name} is truncated (ends inside its checksum)")
        if f.read(1):
            raise SpoolCorrupt(f"{name} has bytes after its checksum")
        if digest != hasher.digest():
            raise SpoolCorrupt(f"{name} fails its checksum (altered or corrupt)")
        return envelope, frames

    @property
    def count(self) -> int:
        return len(self._frames)

    @property
    def size(self) -> int:
        """The bytes of all frames."""
        return sum(size for _, size in self._frames)

    def frames(self) -> Iterator[bytes]:
        for offset, size in self._frames:
            self._file.seek(offset)
            yield self._file.read(size)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SpoolFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def file_id(path: Path, suffix: str) -> str | None:
    """The id in a spool file's name (`<id><suffix>`), None for any other name."""
    name = path.name
    if not name.endswith(suffix) or not ID.fullmatch(name[: -len(suffix)]):
        return None
    return name[: -len(suffix)]


def pending(folder: Path, suffix: str) -> list[Path]:
    """The files of `folder` named `<id><suffix>`, oldest first (temp files and others are not listed)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return [folder / n for n in sorted(names) if not n.startswith(".") and file_id(folder / n, suffix)]


def unlink(path: Path) -> bool:
    """Remove `path`; False when it was gone already (taken by the other side)."""
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
