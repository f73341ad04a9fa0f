"""Self-delimiting, checksummed frames, and a reader that finds them in byte chunks of any size."""

# Frame (integers little-endian):
#   b"GFDC" | format version u8 | kind u8 | body length u32 | crc32 u32 | body
# The crc32 covers version, kind, length and body. Every body starts with the 8-byte id of its stream.

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from geofed_hpc.errors import CodecError

MAGIC = b"GFDC"
VERSION = 2
HEADER, DATA, END = 1, 2, 3
KINDS = {HEADER: "header", DATA: "data", END: "end"}
PREFIX = struct.Struct("<4sBBII")
MAX_BODY = 64 << 20  # the reader refuses longer frames before buffering them


def pieces(kind: int, *parts: bytes | memoryview) -> list[bytes | memoryview]:
    """One frame whose body is the parts back to back, as a list of byte strings to join."""
    head = PREFIX.pack(MAGIC, VERSION, kind, sum(len(p) for p in parts), 0)
    crc = zlib.crc32(head[4:10])
    for p in parts:
        crc = zlib.crc32(p, crc)
    return [head[:10], struct.pack("<I", crc), *parts]


def pack(kind: int, *parts: bytes | memoryview) -> bytes:
    """One frame whose body is the parts back to back."""
    return b"".join(pieces(kind, *parts))


@dataclass
class Frame:
    index: int
    offset: int
    kind: int
    body: memoryview


def _byte_view(chunk: object, what: str) -> memoryview:
    try:
        return memoryview(chunk).cast("B")  # type: ignore[arg-type]
    except TypeError as exc:
        raise CodecError(f"{what}: expected bytes, got {type(chunk).__name__}") from exc


class FrameReader:
    """Frames out of an iterable of byte chunks (zero-copy where a frame lies inside one chunk)."""

    def __init__(self, chunks: Iterable[object]) -> None:
        self._chunks = iter(chunks)
        self._view = memoryview(b"")
        self._pending = bytearray()  # a frame split across chunks, gathered here
        self.index = 0
        self.offset = 0  # stream offset of the next frame

    def _more(self) -> bool:
        for chunk in self._chunks:
            view = _byte_view(chunk, "payload")
            if len(view):
                self._view = view
                return True
        return False

    def _take(self, n: int) -> memoryview | None:
        """The next n bytes (None at a clean end of the stream); CodecError if the stream ends inside them."""
        if not self._pending and len(self._view) >= n:
            out, self._view = self._view[:n], self._view[n:]
            return out
        while len(self._pending) < n:
            if not len(self._view) and not self._more():
                if not self._pending:
                    return None
                raise CodecError(
                    f"payload truncated: frame {self.index} at byte {self.offset} needs {n} bytes, "
                    f"only {len(self._pending)} arrived"
                )
            k = min(n - len(self._pending), len(self._view))
            self._pending += self._view[:k]
            self._view = self._view[k:]
        out = memoryview(bytes(self._pending[:n]))
        del self._pending[:n]
        return out

    def next(self) -> Frame | None:
        """The next verified frame, or None where the stream ends cleanly between frames."""
        where = f"frame {self.index} at byte {self.offset}"
        head = self._take(PREFIX.size)
        if head is None:
            return None
        magic, version, kind, size, crc = PREFIX.unpack(head)
        if magic != MAGIC:
            raise CodecError(f"{where}: bad magic {bytes(magic)!r}, expected {MAGIC!r} (not a geofed delta)")
        if version != VERSION:
            raise CodecError(f"{where}: format version {version} is not supported (this build reads {VERSION})")
        if kind not in KINDS:
            raise CodecError(f"{where}: unknown frame kind {kind}")
        if size > MAX_BODY:
            raise CodecError(f"{where}: frame of {size} bytes exceeds the {MAX_BODY}-byte limit")
        body = self._take(size) if size else memoryview(b"")
        if body is None:
            raise CodecError(f"payload truncated: {where} announces {size} bytes, none arrived")
        if zlib.crc32(body, zlib.crc32(head[4:10])) != crc:
            raise CodecError(f"{where}: crc32 mismatch (stored {crc:#010x}); corrupt {KINDS[kind]} frame")
        frame = Frame(self.index, self.offset, kind, body)
        self.index += 1
        self.offset += PREFIX.size + size
        return frame

    def __iter__(self) -> Iterator[Frame]:
        while (frame := self.next()) is not None:
            yield frame
