"""Split a payload into ~1 MiB chunks behind a header, and reassemble and verify it as it streams."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator

from geofed_hpc.errors import CodecError, ProtocolError
from geofed_hpc.rpc.messages import Chunk, ModelHeader, PushHeader, SplitHeader

Header = ModelHeader | PushHeader | SplitHeader


def digest(payload: bytes) -> bytes:
    """The checksum every streamed payload carries (sha256)."""
    return hashlib.sha256(payload).digest()


def to_chunks(header: Header, payload: bytes, chunk_bytes: int) -> Iterator[Chunk]:
    """Yield the header in the first chunk, then `payload` in pieces of at most `chunk_bytes`."""
    view = memoryview(payload)
    first = view[:chunk_bytes].tobytes()
    if isinstance(header, ModelHeader):
        yield Chunk(data=first, model=header)
    elif isinstance(header, SplitHeader):
        yield Chunk(data=first, split=header)
    else:
        yield Chunk(data=first, push=header)
    for start in range(chunk_bytes, len(payload), chunk_bytes):
        yield Chunk(data=view[start : start + chunk_bytes].tobytes())


def first_header(chunks: Iterator[Chunk], max_bytes: int) -> tuple[Header, Chunk]:
    """Read the first chunk of a stream; raise unless it carries a header announcing at most `max_bytes`."""
    first = next(chunks, None)
    if first is None:
        raise ProtocolError("empty stream: no header chunk arrived")
    header = first.model or first.push or first.split
    if header is None:
        raise ProtocolError("stream does not start with a header chunk")
    if header.total_bytes < 0 or header.total_bytes > max_bytes:
        raise ProtocolError(f"announced payload of {header.total_bytes} bytes exceeds the limit of {max_bytes}")
    if len(header.sha256) != hashlib.sha256().digest_size:
        raise ProtocolError(f"header sha256 must be 32 bytes, got {len(header.sha256)}")
    return header, first


def drain(header: Header, first: Chunk, rest: Iterable[Chunk], sink: Callable[[bytes], object]) -> None:
    """Feed every chunk's bytes to `sink`, hashing as they pass; raise unless length and checksum match."""
    hasher = hashlib.sha256()
    received = 0
    for i, chunk in enumerate(_chain(first, rest)):
        if i > 0 and (chunk.model is not None or chunk.push is not None or chunk.split is not None):
            raise ProtocolError(f"chunk {i} carries a second header")
        received += len(chunk.data)
        if received > header.total_bytes:
            raise ProtocolError(f"stream carries more than the announced {header.total_bytes} bytes")
        hasher.update(chunk.data)
        sink(chunk.data)
    if received != header.total_bytes:
        raise CodecError(f"truncated stream: {received} of {header.total_bytes} announced bytes arrived")
    if hasher.digest() != header.sha256:
        raise CodecError("payload checksum mismatch: the bytes were corrupted in transit")


def _chain(first: Chunk, rest: Iterable[Chunk]) -> Iterator[Chunk]:
    yield first
    yield from rest


def collect(chunks: Iterable[Chunk], max_bytes: int) -> tuple[Header, bytes]:
    """Reassemble a stream in memory; raise unless the header is first and the length and checksum match."""
    it = iter(chunks)
    header, first = first_header(it, max_bytes)
    buf = bytearray(header.total_bytes)
    view = memoryview(buf)
    pos = 0

    def put(data: bytes) -> None:
        nonlocal pos
        view[pos : pos + len(data)] = data
        pos += len(data)

    drain(header, first, it, put)
    return header, buf  # type: ignore[return-value]  # a bytearray, filled in place (no second copy)
