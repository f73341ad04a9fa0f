"""One tensor's section body for each codec, encoded and decoded in bounded pieces."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import zstandard as zstd

from geofed_hpc.codec.minmax import block_params, dequantize, num_blocks, quantize
from geofed_hpc.codec.zstdio import check_frame, compress_pieces, decompress_pieces
from geofed_hpc.errors import CodecError

# Elements per piece: quantization, checks and zstd work on slices this long (64 MiB of float32), never more.
PIECE = 1 << 24


def piece_len(block_size: int) -> int:
    """Elements per piece for `block_size`: a whole number of blocks, about PIECE elements."""
    return max(block_size, PIECE // block_size * block_size)


def _float_pieces(name: str, arr: np.ndarray, step: int) -> Iterator[np.ndarray]:
    """Flat little-endian float32 slices of `arr`; CodecError naming the tensor at the first non-finite value."""
    flat = arr.reshape(-1) if arr.flags.c_contiguous else None
    for start in range(0, arr.size, step):
        raw = flat[start : start + step] if flat is not None else np.asarray(arr.flat[start : start + step])
        with np.errstate(over="ignore"):  # float64 beyond float32 range becomes Inf, refused just below
            piece = raw.astype("<f4", copy=False)
        finite = np.isfinite(piece)
        if not finite.all():
            at = int(np.argmin(finite))
            raise CodecError(
                f"tensor {name!r}: value {raw[at]!r} at flat index {start + at} is NaN, Inf or beyond float32 "
                "range; refusing to encode it"
            )
        yield piece


def encode_body(name: str, arr: np.ndarray, codec: str, block_size: int, cctx: zstd.ZstdCompressor) -> list[bytes]:
    """The section body of one tensor as chunks: fp32 = zstd(float32 LE); int8 = mins, scales, zstd(uint8)."""
    if codec == "fp32":
        return compress_pieces(cctx, _float_pieces(name, arr, PIECE), 4 * arr.size)
    nb = num_blocks(arr.size, block_size)
    mins = np.empty(nb, "<f4")
    scales = np.empty(nb, "<f4")
    step = piece_len(block_size)

    def q_pieces() -> Iterator[np.ndarray]:
        for i, x in enumerate(_float_pieces(name, arr, step)):
            first = i * step // block_size
            m, s = block_params(x, block_size)
            mins[first : first + m.size] = m
            scales[first : first + s.size] = s
            yield quantize(x, m, s, block_size)

    frame = compress_pieces(cctx, q_pieces(), arr.size)
    return [mins.tobytes(), scales.tobytes(), *frame]


def _alloc(numel: int, what: str) -> np.ndarray:
    try:
        return np.empty(numel, "<f4")
    except (MemoryError, ValueError) as exc:
        raise CodecError(f"{what}: cannot allocate {numel} float32 values ({exc})") from exc


def _views(buf: np.ndarray, total: int, step: int) -> Iterator[memoryview]:
    """Consecutive writable byte views: of `buf` itself when it holds `total`, else reusing it `step` at a time."""
    for start in range(0, total, step):
        n = min(step, total - start)
        yield (buf[start : start + n] if buf.size == total else buf[:n]).data


def decode_body(body: memoryview, name: str, shape: tuple[int, ...], codec: str, block_size: int) -> np.ndarray:
    """Rebuild one float32 tensor from its (checksum-verified) section body; CodecError names it."""
    what = f"tensor {name!r}"
    numel = math.prod(shape)
    if codec == "fp32":
        check_frame(body, 4 * numel, what)
        out = _alloc(numel, what)
        step = 4 * PIECE
        for i, _ in enumerate(decompress_pieces(body, _views(out.view(np.uint8), 4 * numel, step), what)):
            piece = out[i * PIECE : (i + 1) * PIECE]
            if not np.isfinite(piece).all():
                at = i * PIECE + int(np.argmin(np.isfinite(piece)))
                raise CodecError(f"{what}: decoded value at flat index {at} is NaN or Inf (corrupt payload)")
        return out.astype(np.float32, copy=False).reshape(shape)
    nb = num_blocks(numel, block_size)
    if len(body) < 8 * nb:
        raise CodecError(f"{what}: section of {len(body)} bytes cannot hold the {nb} block minima and scales")
    mins = np.frombuffer(body[: 4 * nb], "<f4")
    scales = np.frombuffer(body[4 * nb : 8 * nb], "<f4")
    if not (np.isfinite(mins).all() and np.isfinite(scales).all() and (scales >= 0).all()):
        raise CodecError(f"{what}: block minima or scales are NaN, Inf or negative (corrupt payload)")
    frame = body[8 * nb :]
    check_frame(frame, numel, what)
    out = _alloc(numel, what)
    step = piece_len(block_size)
    qbuf = np.empty(min(step, numel), np.uint8)
    for i, view in enumerate(decompress_pieces(frame, _views(qbuf, numel, step), what)):
        start, first = i * step, i * step // block_size
        q = qbuf[: len(view)]
        last = first + num_blocks(q.size, block_size)
        dequantize(q, mins[first:last], scales[first:last], block_size, out[start : start + q.size])
    return out.astype(np.float32, copy=False).reshape(shape)
