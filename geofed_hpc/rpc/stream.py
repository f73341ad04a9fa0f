"""Split a payload into ~1 MiB chunks behind a header, and reassemble and verify it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

from geofed_hpc.errors import CodecError, ProtocolError
from geofed_hpc.rpc.messages import Chunk, ModelHeader, PushHeader


def digest(payload: bytes) -> bytes:
    """The checksum every streamed payload carries (sha256)."""
    return hashlib.sha256(payload).digest()


def to_chunks(header: ModelHeader | PushHeader, payload: bytes, chunk_bytes: int) -> Iterator[Chunk]:
    """Yield the header in the first chunk, then `payload` in pieces of at most `chunk_bytes`."""
    view = memoryview(payload)
    first = view[:chunk_bytes].tobytes()
    if isinstance(header, ModelHeader):
        yield Chunk(data=first, model=header)
    else:
        yield Chunk(data=first, push=header)
    for start in range(chunk_bytes, len(payload), chunk_bytes):
        yield Chunk(data=view[start : start + chunk_bytes].tobytes())


def collect(chunks: Iterable[Chunk], max_bytes: int) -> tuple[ModelHeader | PushHeader, bytes]:
    """Reassemble a stream; raise unless the header is first and the length and checksum match."""
    header: ModelHeader | PushHeader | None = None
    parts: list[bytes] = []
    received = 0
    for i, chunk in enumerate(chunks):
        carried = chunk.model or chunk.push
        if i == 0:
            if carried is None:
                raise ProtocolError("stream does not start with a header chunk")
            header = carried
            if header.total_bytes < 0 or header.total_bytes > max_bytes:
                raise ProtocolError(f"announced payload of {header.total_bytes} bytes exceeds the limit of {max_bytes}")
        elif carried is not None:
            raise ProtocolError(f"chunk {i} carries a second header")
        received += len(chunk.data)
        assert header is not None
        if received > header.total_bytes:
            raise ProtocolError(f"stream carries more than the announced {header.total_bytes} bytes")
        parts.append(chunk.data)
    if header is None:
        raise ProtocolError("empty stream: no header chunk arrived")
    if received != header.total_bytes:
        raise CodecError(f"truncated stream: {received} of {header.total_bytes} announced bytes arrived")
    payload = b"".join(parts)
    if digest(payload) != header.sha256:
        raise CodecError("payload checksum mismatch: the bytes were corrupted in transit")
    return header, payload
