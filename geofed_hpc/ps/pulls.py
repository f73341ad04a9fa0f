"""Whole-model pulls: the encoded model of a version written once to an unlinked file and streamed from it."""

from __future__ import annotations

import hashlib
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import to_chunks


class Spilled:
    """An encoded payload in an open file (one with no name any more, removed once open so that nothing is left
    behind when the PS dies, or a kept update's): read in chunks with pread, through the page cache, never held in
    the PS's memory. The file closes once nothing refers to it (a stream still sending it keeps it)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self._closer = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, path: Path) -> Spilled:
        """A file as it is now (FileNotFoundError: gone)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, size)

    def __len__(self) -> int:
        return self.size

    def chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        for start in range(0, self.size, chunk_bytes):
            data = os.pread(self.fd, min(chunk_bytes, self.size - start), start)
            if not data:
                raise OSError(f"the encoded model file ended early, at byte {start} of {self.size}")
            yield data


# What a pull sends: bytes, a file, or an update chain's parts (each bytes or a file) one after the other.
Payload = bytes | Spilled | list[bytes | Spilled]


def size_of(payload: Payload) -> int:
    parts = payload if isinstance(payload, list) else [payload]
    return sum(len(p) for p in parts)


def chunks_of(payload: Payload) -> Iterator[bytes]:
    """A payload's bytes in order, its files read a MiB at a time."""
    for part in payload if isinstance(payload, list) else [payload]:
        yield from part.chunks(1 << 20) if isinstance(part, Spilled) else [part]


def sha256_of(payload: Payload) -> bytes:
    """The sha256 of a payload's bytes, its files read a chunk at a time."""
    sha = hashlib.sha256()
    for data in chunks_of(payload):
        sha.update(data)
    return sha.digest()


@dataclass
class ModelFile:
    """The fp32 encoding of the model at `version`: its bytes (`payload`, in memory or spilled), size and sha256."""

    version: int
    payload: Payload
    size: int
    sha256: bytes


def write_model(params: Mapping[str, np.ndarray], version: int, path: Path | None) -> ModelFile:
    """Encode `params` (fp32, piece by piece) to `path` (opened, then unlinked at once) hashing as it goes; without
    a path, in memory."""
    sha = hashlib.sha256()
    frames = codec.encode_frames(params, CodecConfig(name="fp32"))
    if path is None:
        payload = b"".join(frames)
        sha.update(payload)
        return ModelFile(version, payload, len(payload), sha.digest())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        size = write_frames(fd, frames, sha)
    except BaseException:
        os.close(fd)
        raise
    return ModelFile(version, Spilled(fd, size), size, sha.digest())


def write_frames(fd: int, frames: Iterable[bytes], sha: hashlib._Hash | None = None) -> int:
    """Write `frames` to `fd` whole, one after the other (hashed into `sha`, if given); the bytes written."""
    size = 0
    for frame in frames:
        if sha is not None:
            sha.update(frame)
        view = memoryview(frame)
        while view:
            view = view[os.write(fd, view) :]
        size += len(frame)
    return size


def payload_chunks(header: m.ModelHeader, payload: Payload, chunk_bytes: int) -> Iterator[m.Chunk]:
    """The chunks of a pull: the header in the first, then the payload's bytes (read from its file when spilled)."""
    if not isinstance(payload, (Spilled, list)):  # bytes, or the bytearray of an encoded update (the downlink's)
        yield from to_chunks(header, payload, chunk_bytes)
        return
    first = True
    for part in payload if isinstance(payload, list) else [payload]:
        if isinstance(part, Spilled):
            pieces: Iterator[bytes] = part.chunks(chunk_bytes)
        else:
            view = memoryview(part)
            pieces = (view[i : i + chunk_bytes].tobytes() for i in range(0, len(view), chunk_bytes))
        for data in pieces:
            yield m.Chunk(data=data, model=header) if first else m.Chunk(data=data)
            first = False
    if first:
        yield m.Chunk(data=b"", model=header)
