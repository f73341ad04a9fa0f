"""zstd for piece contents: compress a list of parts, and decompress into a buffer of exactly the expected size."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import zstandard as zstd

from geofed_hpc.errors import CodecError

_MAX_WINDOW = 1 << 27  # the largest window zstd levels 1..22 pick; a frame asking for more is refused
_WRITE = 1 << 20


def compressor(level: int) -> zstd.ZstdCompressor:
    """zstd at `level`; at the fast levels with a 128 KiB window and small tables: quantized symbols have few long
    matches, and this runs ~40% faster for +0.3% size."""
    if level > 3:
        return zstd.ZstdCompressor(level=level)
    params = zstd.ZstdCompressionParameters.from_level(level, window_log=17, hash_log=12, min_match=7)
    return zstd.ZstdCompressor(compression_params=params)


def compress_parts(cctx: zstd.ZstdCompressor, parts: Sequence[np.ndarray]) -> Iterator[bytes]:
    """One zstd frame (content size recorded) holding the parts back to back, as output chunks."""
    cobj = cctx.compressobj(size=sum(p.nbytes for p in parts))
    for part in parts:
        out = cobj.compress(part.data.cast("B"))
        if out:
            yield out
    yield cobj.flush()


class _Sink:
    """Where the decompressor writes: a fixed buffer that refuses to overflow."""

    def __init__(self, buf: np.ndarray, what: str) -> None:
        self.buf, self.what, self.pos = buf, what, 0

    def write(self, data: bytes) -> int:
        n = len(data)
        if self.pos + n > self.buf.size:
            raise CodecError(f"{self.what}: zstd data holds more than the {self.buf.size} bytes the header implies")
        self.buf[self.pos : self.pos + n] = np.frombuffer(data, np.uint8)
        self.pos += n
        return n


def decompressor() -> zstd.ZstdDecompressor:
    """A zstd decompressor that refuses windows beyond what our levels pick. Reuse one for frame after frame on a
    thread (never two frames at once): making one costs ~10 us, most of it a CPU feature probe that holds the GIL
    and, under a hypervisor, traps to it."""
    return zstd.ZstdDecompressor(max_window_size=_MAX_WINDOW)


class Inflater:
    """Decompresses one zstd frame fed in pieces straight into `buf`; no byte more or less than its size. With
    `dctx` (from `decompressor()`, used for nothing else until this frame is finished) no new one is made."""

    def __init__(self, buf: np.ndarray, what: str, dctx: zstd.ZstdDecompressor | None = None) -> None:
        self.what = what
        self._sink = _Sink(buf, what)  # no reference back to self: nothing waits for the cycle collector
        sink: Any = self._sink  # a file-like object with write(): all the decompressor needs
        self._writer = (dctx or decompressor()).stream_writer(sink, write_size=_WRITE, closefd=False)

    def feed(self, data: memoryview) -> None:
        """Decompress the next compressed bytes."""
        try:
            self._writer.write(data)
        except zstd.ZstdError as exc:
            raise CodecError(f"{self.what}: zstd data is corrupt ({exc})") from exc

    def finish(self) -> None:
        """Check that exactly the expected number of bytes came out."""
        try:
            self._writer.flush()
        except zstd.ZstdError as exc:
            raise CodecError(f"{self.what}: zstd data is corrupt ({exc})") from exc
        sink = self._sink
        if sink.pos != sink.buf.size:
            raise CodecError(f"{self.what}: zstd data ends early, after {sink.pos} of {sink.buf.size} bytes")
