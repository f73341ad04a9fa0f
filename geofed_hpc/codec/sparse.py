"""Sparse pieces: per chunk the top-k values by magnitude, sign-magnitude quantized, positions as gaps for zstd."""

# Content of a piece of n values in chunks of C (the last may be shorter), k_j values kept in chunk j, K in all:
#   lo f32[nb] | step f32[nb] | symbols (b bits each, sign then magnitude, MSB first, packed) | gaps u16[K] as
#   two byte planes (low bytes, then high bytes)
# A kept value is +-(lo + q * step) with q < 2**(b-1) (b = 1: the chunk's mean magnitude, lo, step 0). Positions
# are per chunk: the first offset, then each offset minus the one before (so >= 1); zstd codes the whole content.
# docs/compression.md has the measurement behind this choice (bench/sparse_index.py).

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from geofed_hpc.errors import CodecError

MAX_CHUNK = 1 << 16
_SCRATCH_ROWS = 1 << 20  # values of a piece's full chunks selected at once (bounded temporaries)
_F32_MAX = float(np.finfo(np.float32).max)


@dataclass
class SparseTensor:
    """A tensor of `shape` that is zero but at flat `indices` (int64, strictly increasing), holding `values`; with
    `mean` (float32, shape[-1] values) that row is added to every row first (codec.mean_row)."""

    shape: tuple[int, ...]
    indices: np.ndarray
    values: np.ndarray
    mean: np.ndarray | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def dense(self) -> np.ndarray:
        """The tensor as a float32 array (what decode gives for it: mean + value at a kept position, in float32)."""
        out = np.zeros(self.size, np.float32)
        out[self.indices] = self.values
        if self.mean is not None:
            out += tile(self.mean, 0, self.size)
        return out.reshape(self.shape)

    def add_into(self, target: np.ndarray, factor: np.float32 | float = 1.0) -> None:
        """target += factor * self, the same float32 adds as with the dense tensor, touching only the kept positions
        and, with a mean row, adding it to every row (a broadcast add, no dense copy)."""
        flat = target.reshape(-1)
        f = np.float32(factor)
        values = self.values
        if self.mean is not None and flat.size:
            values = values + self.mean[self.indices % self.mean.size]  # the dense value: mean + kept, in float32
            before = flat[self.indices]
            rows = flat.reshape(-1, self.mean.size)
            rows += self.mean if factor == 1 else f * self.mean
            flat[self.indices] = before
        if factor == 1:
            flat[self.indices] += values
        else:
            flat[self.indices] += f * values

    def read(self, start: int, stop: int, factor: np.float32 | float = 1.0) -> np.ndarray:
        """Values [start, stop) of zeros + factor * self as a new flat float32 array: the same float32 operations
        as `add_into` makes on a zero tensor, on that range alone."""
        out = np.zeros(stop - start, np.float32)
        f = np.float32(factor)
        lo, hi = np.searchsorted(self.indices, [start, stop])
        idx = self.indices[lo:hi]
        values = self.values[lo:hi]
        if self.mean is not None and out.size:
            values = values + self.mean[idx % self.mean.size]
            out += tile(self.mean if factor == 1 else f * self.mean, start, out.size)
            out[idx - start] = 0
        if factor == 1:
            out[idx - start] += values
        else:
            out[idx - start] += f * values
        return out

    def scale(self, factor: np.float32) -> None:
        """self *= factor, in place."""
        self.values *= factor
        if self.mean is not None:
            self.mean *= factor

    def sq_norm(self) -> float:
        # float32 dots: a float64 copy's dot ran on OpenBLAS threads that spin after it (measured: 2.5x the PS's
        # CPU per sparse push of bench/wire.py)
        total = float(np.dot(self.values, self.values)) if self.values.size else 0.0
        if self.mean is not None and self.mean.size:
            m = self.mean.astype(np.float64)
            total += self.size // m.size * float(np.dot(m, m))
            if self.values.size:
                total += 2 * float(np.dot(self.values, self.mean[self.indices % m.size]))
        return total


def column_sums(x: np.ndarray, start: int, row: int, out: np.ndarray) -> None:
    """Add flat piece `x`, which starts at flat index `start` of a tensor with rows of `row` values, into the
    float64 per-column sums `out`."""
    phase = start % row
    head = min((row - phase) % row, x.size)
    out[phase : phase + head] += x[:head]
    body = x[head:]
    full = body.size // row * row
    if full:
        out += body[:full].reshape(-1, row).sum(axis=0, dtype=np.float64)
    tail = body[full:]
    out[: tail.size] += tail


def tile(mean: np.ndarray, start: int, n: int) -> np.ndarray:
    """The mean row's value at each flat index start .. start + n of a tensor with rows of mean.size values."""
    phase = start % mean.size
    return np.resize(np.concatenate([mean[phase:], mean[:phase]]), n)


class DenseView(Mapping[str, np.ndarray]):
    """A mapping of dense and sparse (or packed) tensors read as dense arrays: one that is not an array is densified
    when it is looked up."""

    def __init__(self, tensors: Mapping[str, Any]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> np.ndarray:
        v = self._tensors[name]
        return v if isinstance(v, np.ndarray) else v.dense()

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


@dataclass(frozen=True)
class Layout:
    """Chunks of a piece: `full` chunks of `chunk` values keeping `keep` each, then a tail of `tail` values keeping
    `tail_keep`."""

    chunk: int
    keep: int
    bits: int
    full: int
    tail: int
    tail_keep: int

    @classmethod
    def of(cls, n: int, chunk: int, keep: int, bits: int) -> Layout:
        tail = n % chunk
        return cls(chunk, keep, bits, n // chunk, tail, min(tail, -(-tail * keep // chunk)))

    @property
    def chunks(self) -> int:
        return self.full + (self.tail > 0)

    @property
    def kept(self) -> int:
        return self.full * self.keep + self.tail_keep

    def counts(self) -> np.ndarray:
        """Values kept per chunk."""
        return np.array([self.keep] * self.full + ([self.tail_keep] if self.tail else []), np.int64)

    def size(self) -> int:
        """Bytes of the content."""
        return 8 * self.chunks + _nbytes(self.kept * self.bits) + 2 * self.kept


def _nbytes(bits: int) -> int:
    return (bits + 7) // 8


def keep_of(chunk: int, density: float) -> int:
    """Values kept per chunk (chunk x density, which the config checks is a whole number)."""
    return max(1, round(chunk * density))


# ------------------------------------------------------------------------------------------------ selection
def _top_rows(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of (r, c) float32: the sorted offsets of its k largest magnitudes and their values."""
    c = rows.shape[1]
    if k >= c:
        offs = np.broadcast_to(np.arange(c), rows.shape).copy()
    else:
        offs = np.argpartition(np.abs(rows), c - k, axis=1)[:, c - k :]
        offs.sort(axis=1)
    return offs, np.take_along_axis(rows, offs, axis=1)


def select(x: np.ndarray, lay: Layout) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """The kept entries as groups (first chunk, chunk length, offsets within their chunk, values), offsets and
    values (chunks, k) arrays: full chunks a bounded number at a time, then the tail."""
    out = []
    step = max(1, _SCRATCH_ROWS // lay.chunk)
    for first in range(0, lay.full, step):
        last = min(lay.full, first + step)
        rows = x[first * lay.chunk : last * lay.chunk].reshape(-1, lay.chunk)
        out.append((first, lay.chunk, *_top_rows(rows, lay.keep)))
    if lay.tail:
        out.append((lay.full, lay.tail, *_top_rows(x[lay.full * lay.chunk :].reshape(1, -1), lay.tail_keep)))
    return out


# ------------------------------------------------------------------------------------------------ values
def quantize(vals: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo, step, symbols) of (chunks, k) kept values: per chunk float32 lo and step, uint8 symbols."""
    levels = 1 << (bits - 1)
    mag = np.abs(vals.astype(np.float64))
    if vals.shape[1] == 0:
        zero = np.zeros(vals.shape[0], np.float32)
        return zero, zero.copy(), np.zeros(vals.shape, np.uint8)
    if levels == 1:
        lo = mag.mean(axis=1).astype(np.float32)
        step = np.zeros_like(lo)
        q = np.zeros(vals.shape, np.uint8)
    else:
        lo = mag.min(axis=1).astype(np.float32)  # exact: a float32 magnitude
        step = ((mag.max(axis=1) - lo) / (levels - 1)).astype(np.float32)
        s = step.astype(np.float64)[:, None]
        t = np.divide(mag - lo[:, None], s, out=np.zeros_like(mag), where=s > 0)
        q = np.clip(np.rint(t), 0, levels - 1).astype(np.uint8)
    sign = np.signbit(vals).astype(np.uint8)
    return lo, step, (sign << (bits - 1)) | q


def dequantize(lo: np.ndarray, step: np.ndarray, sym: np.ndarray, bits: int) -> np.ndarray:
    """Float32 values of (chunks, k) symbols: +-(lo + q * step), computed in float64 then rounded once."""
    q = (sym & ((1 << (bits - 1)) - 1)).astype(np.float64)
    mag = lo.astype(np.float64)[:, None] + q * step.astype(np.float64)[:, None]
    np.minimum(mag, _F32_MAX, out=mag)
    mag *= 1.0 - 2.0 * (sym >> (bits - 1))  # the sign: exact in float64, and rounding to float32 is symmetric
    return mag.astype(np.float32)  # (a masked np.negative after the cast took twice as long as all of this)


def pack_bits(sym: np.ndarray, width: int) -> np.ndarray:
    """`width` low bits of each uint symbol, MSB first, packed into bytes."""
    if width == 0 or sym.size == 0:
        return np.zeros(0, np.uint8)
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    bits = ((sym.reshape(-1, 1).astype(np.int64) >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1))


def unpack_bits(data: np.ndarray, count: int, width: int) -> np.ndarray:
    """Inverse of pack_bits: `count` symbols of `width` bits (int64)."""
    if width == 0 or count == 0:
        return np.zeros(count, np.int64)
    bits = np.unpackbits(data, count=count * width).reshape(count, width)
    out = bits[:, 0].astype(np.int64)
    for j in range(1, width):  # shifts: an int64 matrix product took 3x as long
        out <<= 1
        out |= bits[:, j]
    return out


# ------------------------------------------------------------------------------------------------ positions
def gaps(offs: np.ndarray) -> np.ndarray:
    """Per row of sorted (chunks, k) offsets: the first offset, then the steps between them (uint16)."""
    return np.diff(offs, axis=1, prepend=0).astype(np.uint16)


def offsets(g: np.ndarray, c: int, what: str) -> np.ndarray:
    """(rows, k) offsets from their gaps; CodecError unless each row is strictly increasing and below c."""
    # one cumulative sum over the whole array, less each row's start: numpy sums along short rows holding the GIL
    run = np.cumsum(g.reshape(-1), dtype=np.int64).reshape(g.shape)
    offs = run - (run[:, :1] - g[:, :1])
    if g.shape[1] > 1 and np.count_nonzero(g == 0) > np.count_nonzero(g[:, 0] == 0):  # a row's first gap may be 0
        bad = int(np.argmax((g[:, 1:] == 0).any(axis=1)))
        raise CodecError(f"{what}: sparse chunk {bad}: positions are not strictly increasing (corrupt payload)")
    if g.shape[1] and (offs[:, -1] >= c).any():
        bad = int(np.argmax(offs[:, -1] >= c))
        raise CodecError(
            f"{what}: sparse chunk {bad} has position {int(offs[bad, -1])}, past its {c} values (corrupt payload)"
        )
    return offs


# ------------------------------------------------------------------------------------------------ a piece
def encode(x: np.ndarray, lay: Layout, recon: np.ndarray | None) -> list[np.ndarray]:
    """The content of flat float32 piece `x`; fills `recon` (zeros but at the kept positions) with what decoding
    gives."""
    los, steps, syms, gs = [], [], [], []
    if recon is not None:
        recon[...] = 0
    for first, c, offs, vals in select(x, lay):
        lo, step, sym = quantize(vals, lay.bits)
        los.append(lo)
        steps.append(step)
        syms.append(sym.reshape(-1))
        gs.append(gaps(offs).reshape(-1))
        if recon is not None:
            at = first * lay.chunk + (offs + c * np.arange(offs.shape[0])[:, None])
            recon[at.reshape(-1)] = dequantize(lo, step, sym, lay.bits).reshape(-1)
    cat = np.concatenate
    planes = cat(gs).view(np.uint8).reshape(-1, 2) if gs else np.zeros((0, 2), np.uint8)
    return [
        cat(los).view(np.uint8),
        cat(steps).view(np.uint8),
        pack_bits(cat(syms), lay.bits),
        np.ascontiguousarray(planes[:, 0]),
        np.ascontiguousarray(planes[:, 1]),
    ]


def decode(content: np.ndarray, lay: Layout, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(flat offsets within the piece, int64 strictly increasing; float32 values) of a piece's content (exactly
    lay.size() bytes); CodecError names `what` for a corrupt one."""
    nb, kept = lay.chunks, lay.kept
    lo = content[: 4 * nb].view("<f4")
    step = content[4 * nb : 8 * nb].view("<f4")
    if not (np.isfinite(lo).all() and np.isfinite(step).all() and (lo >= 0).all() and (step >= 0).all()):
        raise CodecError(f"{what}: sparse chunk magnitudes or steps are NaN, Inf or negative (corrupt payload)")
    pos = 8 * nb + _nbytes(kept * lay.bits)
    sym = unpack_bits(content[8 * nb : pos], kept, lay.bits).astype(np.uint8)
    g = content[pos : pos + kept].astype(np.uint16) | (content[pos + kept : pos + 2 * kept].astype(np.uint16) << 8)
    flat, values = [], []
    done = 0
    for c, k, rows, first in (
        (lay.chunk, lay.keep, lay.full, 0),
        (lay.tail, lay.tail_keep, int(lay.tail > 0), lay.full),
    ):
        if rows == 0:
            continue
        span = slice(done, done + rows * k)
        offs = offsets(g[span].reshape(rows, k), c, what)
        done += rows * k
        s = sym[span].reshape(rows, k)
        values.append(dequantize(lo[first : first + rows], step[first : first + rows], s, lay.bits).reshape(-1))
        flat.append((offs + first * lay.chunk + c * np.arange(rows)[:, None]).reshape(-1))
    if not flat:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(flat), np.concatenate(values)
