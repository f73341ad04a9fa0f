"""Streaming zstd compression, and decompression bounded by a size the validated header dictates."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import zstandard as zstd

from geofed_hpc.errors import CodecError

_MAGIC = zstd.MAGIC_NUMBER.to_bytes(4, "little")
_BLOCK_MAX = 128 << 10  # zstd's Block_Maximum_Size: no block regenerates more bytes than this
_MAX_WINDOW = 1 << 27  # the largest window zstd levels 1..22 pick; a frame asking for more is refused


def compressor(level: int) -> zstd.ZstdCompressor:
    """A zstd compressor for one encode call (not shared between threads)."""
    return zstd.ZstdCompressor(level=level)


def compress_pieces(cctx: zstd.ZstdCompressor, pieces: Iterator[np.ndarray], total: int) -> list[bytes]:
    """One zstd frame holding `total` bytes, fed piece by piece; returns the frame's chunks."""
    cobj = cctx.compressobj(size=total)
    chunks = [cobj.compress(piece.view(np.uint8).data) for piece in pieces]
    chunks.append(cobj.flush())
    return [c for c in chunks if c]


def check_frame(frame: memoryview, expected: int, what: str) -> None:
    """Refuse `frame` unless it is exactly one well-formed zstd frame able to regenerate `expected` bytes.

    Only headers are read (the block headers are walked, nothing is decompressed), so a frame that lies about
    its size, is cut short or is followed by stray bytes is refused before anything is allocated for it.
    """
    if bytes(frame[:4]) != _MAGIC:
        raise CodecError(f"{what}: zstd frame has a bad magic number")
    try:
        pos = zstd.frame_header_size(frame)
        params = zstd.get_frame_parameters(frame)
    except zstd.ZstdError as exc:
        raise CodecError(f"{what}: zstd frame header is invalid ({exc})") from exc
    if params.window_size > _MAX_WINDOW:
        raise CodecError(f"{what}: zstd frame asks for a {params.window_size}-byte window (limit {_MAX_WINDOW})")
    if params.content_size not in (zstd.CONTENTSIZE_UNKNOWN, zstd.CONTENTSIZE_ERROR, expected):
        raise CodecError(f"{what}: zstd frame holds {params.content_size} bytes, the header says {expected}")
    bound = 0
    last = False
    while not last:
        if pos + 3 > len(frame):
            raise CodecError(f"{what}: zstd frame is cut short in a block header")
        head = int.from_bytes(frame[pos : pos + 3], "little")
        last, kind, size = bool(head & 1), (head >> 1) & 3, head >> 3
        if kind == 3 or size > _BLOCK_MAX:
            raise CodecError(f"{what}: zstd frame holds an invalid block (type {kind}, {size} bytes)")
        pos += 3 + (1 if kind == 1 else size)
        bound += _BLOCK_MAX if kind == 2 else size
    pos += 4 if params.has_checksum else 0
    if pos != len(frame):
        how = "is cut short" if pos > len(frame) else f"is followed by {len(frame) - pos} stray bytes"
        raise CodecError(f"{what}: zstd frame {how}")
    if bound < expected:
        raise CodecError(f"{what}: zstd frame can regenerate at most {bound} bytes, the header says {expected}")


def decompress_pieces(frame: memoryview, buffers: Iterator[memoryview], what: str) -> Iterator[memoryview]:
    """Fill each writable buffer in turn from `frame` (already checked) and yield it; no byte more or less."""
    dctx = zstd.ZstdDecompressor(max_window_size=_MAX_WINDOW)
    try:
        with dctx.stream_reader(frame, read_across_frames=False, closefd=False) as reader:
            for buf in buffers:
                filled = 0
                while filled < len(buf):
                    n = reader.readinto(buf[filled:])
                    if n == 0:
                        raise CodecError(f"{what}: zstd frame ends early, after {reader.tell()} bytes")
                    filled += n
                yield buf
            if reader.read(1):
                raise CodecError(f"{what}: zstd frame holds more bytes than the header says")
    except zstd.ZstdError as exc:
        raise CodecError(f"{what}: zstd data is corrupt ({exc})") from exc
