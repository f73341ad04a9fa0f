"""What each codec makes of one piece of float32 values (its content), and how it rebuilds them."""

# Content layouts (n values, nb blocks; all little-endian; planes are one byte of every symbol in turn):
#   fp32        4 planes of the float32 bytes                          (lossless; zstd)
#   bf16        2 planes of bfloat16 (high byte first)                 (zstd)
#   int16/8/4/2 mins f32[nb] | scales f32[nb] | modes u8[nb] | symbols (int16: 2 planes; int4: 2 per byte;
#               int2: 4 per byte, lowest bits first)                   (zstd)
#   paper_int8  huffman segments + bitstream of global min-max uint8 symbols (no zstd)
#   sparse      per chunk (block_size) the top-k values, quantized, and their positions (sparse.py)   (zstd)

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from geofed_hpc.codec import huffman, predict, sparse
from geofed_hpc.codec.quant import SCRATCH, block_minmax, block_scales, dequantize, num_blocks, quantize
from geofed_hpc.errors import CodecError

LEVELS = {"int16": 65535, "int8": 255, "int4": 15, "int2": 3}
# sparse: a matrix sends its mean row when top-k keeps this many values per column on average (rows x density):
# one float32 per column then adds at most about 5% to the matrix's bits
MEAN_ROW_MIN_KEPT = 64
MINMAX = tuple(LEVELS)
_BF16_MAX = 0x7F7F  # largest finite bfloat16 magnitude


@dataclass
class Plan:
    """What a piece needs beyond its values: codec, blocks, row length, and the payload-wide quantities."""

    codec: str
    block_size: int
    row: int = 0
    global_range: float = 0.0
    rng: np.random.Generator | None = None
    paper_min: float = 0.0
    paper_scale: float = 0.0
    lengths: np.ndarray | None = None
    keep: int = 0  # sparse: values kept per chunk of block_size
    value_bits: int = 0  # sparse: bits per kept value
    mean_row: bool = False  # sparse: a matrix sends its mean row (in its first piece) and top-k of the rest
    dense_codec: str = ""  # sparse: the min-max codec of tensors of fewer than dense_below values
    dense_block: int = 0  # ... and its block size
    dense_below: int = 0

    def layout(self, n: int) -> sparse.Layout:
        """sparse: the chunks of a piece of n values."""
        return sparse.Layout.of(n, self.block_size, self.keep, self.value_bits)

    def for_tensor(self, shape: tuple[int, ...], global_range: float = 0.0) -> Plan:
        """The plan of one tensor's pieces: a sparse payload's small tensors go with its dense codec."""
        row = shape[-1] if len(shape) >= 2 else 0
        if self.codec == "sparse" and math.prod(shape) < self.dense_below:
            return Plan(self.dense_codec, self.dense_block, row=row, global_range=global_range, rng=self.rng)
        return dataclasses.replace(self, row=row)

    def has_mean(self, shape: tuple[int, ...]) -> bool:
        """sparse: whether the tensor's first piece starts with its mean row (float32, shape[-1] values): a sparse
        matrix whose rows keep MEAN_ROW_MIN_KEPT values per column on average (an embedding, an output layer)."""
        if not (self.mean_row and len(shape) >= 2 and shape[-1] > 0 and self.for_tensor(shape).codec == "sparse"):
            return False
        rows = math.prod(shape) // shape[-1]
        return rows * self.keep >= MEAN_ROW_MIN_KEPT * self.block_size


def content_size(plan: Plan, n: int) -> int:
    """Bytes of a piece's content before entropy coding (zstd codecs only)."""
    if plan.codec == "sparse":
        return plan.layout(n).size()
    nb = num_blocks(n, plan.block_size)
    return {
        "fp32": 4 * n,
        "bf16": 2 * n,
        "int16": 9 * nb + 2 * n,
        "int8": 9 * nb + n,
        "int4": 9 * nb + (n + 1) // 2,
        "int2": 9 * nb + (n + 3) // 4,
    }[plan.codec]


def _planes(sym: np.ndarray, order: tuple[int, ...]) -> list[np.ndarray]:
    raw = sym.view(np.uint8).reshape(sym.size, sym.itemsize)
    return [np.ascontiguousarray(raw[:, k]) for k in order]


def _unplane(content: np.ndarray, sym: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
    n = sym.size
    raw = sym.view(np.uint8).reshape(n, sym.itemsize)
    for i, k in enumerate(order):
        raw[:, k] = content[i * n : (i + 1) * n]
    return sym


def _to_bf16(x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """bfloat16 bits of float32 `x`: round to nearest even (or stochastically), saturating instead of Inf."""
    out = np.empty(x.size, "<u2")
    bits = x.view("<u4")
    for start in range(0, x.size, SCRATCH):
        b = bits[start : start + SCRATCH]
        if rng is None:
            r = (b >> 16) & 1
            r += 0x7FFF
        else:
            r = rng.integers(0, 1 << 16, size=b.size, dtype=np.uint32)
        r += b
        r >>= 16
        hi = r.astype(np.uint16)
        over = (hi & 0x7FFF) == 0x7F80
        hi[over] = (hi[over] & 0x8000) | _BF16_MAX
        out[start : start + b.size] = hi
    return out


def _from_bf16(h: np.ndarray, out: np.ndarray) -> None:
    view = out.view("<u4")
    for start in range(0, h.size, SCRATCH):
        v = view[start : start + SCRATCH]
        v[...] = h[start : start + SCRATCH]
        v <<= 16


def encode(
    x: np.ndarray, plan: Plan, recon: np.ndarray | None, bounds: tuple[np.ndarray, np.ndarray] | None = None
) -> list[np.ndarray]:
    """The content of flat finite float32 piece `x` as byte arrays; fills `recon` with the values decoding gives.

    `bounds`: the per-block minima and maxima of `x` when already known.
    """
    if plan.codec == "fp32":
        if recon is not None:
            recon[...] = x
        return _planes(x, (0, 1, 2, 3))
    if plan.codec == "bf16":
        h = _to_bf16(x, plan.rng)
        if recon is not None:
            _from_bf16(h, recon)
        return _planes(h, (1, 0))
    if plan.codec == "paper_int8":
        assert plan.lengths is not None
        q = paper_symbols(x, plan)
        if recon is not None:
            dequantize(
                q, np.array([plan.paper_min], np.float32), np.array([plan.paper_scale], np.float32), x.size, recon
            )
        return [np.frombuffer(huffman.encode(q, plan.lengths), np.uint8)]
    if plan.codec == "sparse":
        return sparse.encode(x, plan.layout(x.size), recon)
    levels = LEVELS[plan.codec]
    mins, maxs = bounds if bounds is not None else block_minmax(x, plan.block_size)
    scales = block_scales(mins, maxs, levels, plan.global_range)
    q = quantize(x, mins, scales, plan.block_size, levels, plan.rng)
    if recon is not None:
        dequantize(q, mins, scales, plan.block_size, recon)
    modes = predict.choose(q, plan.block_size, plan.row)
    if modes.any():
        predict.apply(q, modes, plan.block_size, plan.row, levels)
    head = [mins.view(np.uint8), scales.view(np.uint8), modes]
    if plan.codec == "int16":
        return head + _planes(q, (0, 1))
    if plan.codec == "int4":
        packed = np.zeros((q.size + 1) // 2, np.uint8)
        packed[:] = q[0::2]
        packed[: q.size // 2] |= q[1::2] << 4
        return [*head, packed]
    if plan.codec == "int2":
        packed = np.zeros((q.size + 3) // 4, np.uint8)
        for i in range(4):
            part = q[i::4]
            packed[: part.size] |= part << (2 * i)
        return [*head, packed]
    return [*head, q]


def paper_symbols(x: np.ndarray, plan: Plan) -> np.ndarray:
    """The paper's uint8 symbols: one min-max pair for the whole payload."""
    return quantize(x, np.array([plan.paper_min], np.float32), np.array([plan.paper_scale], np.float32), x.size, 255)


def decode(content: np.ndarray, plan: Plan, out: np.ndarray, what: str, start: int = 0) -> None:
    """Rebuild len(out) float32 values (flat index `start` on) from their content; CodecError names `what`."""
    n = out.size
    if plan.codec == "paper_int8":
        assert plan.lengths is not None
        q = huffman.decode(content.data, n, plan.lengths, what)
        dequantize(q, np.array([plan.paper_min], np.float32), np.array([plan.paper_scale], np.float32), n, out)
        return
    if plan.codec == "fp32":
        _unplane(content, out, (0, 1, 2, 3))
        _check_finite(out, what, start)
        return
    if plan.codec == "bf16":
        _from_bf16(_unplane(content, np.empty(n, "<u2"), (1, 0)), out)
        _check_finite(out, what, start)
        return
    if plan.codec == "sparse":
        idx, vals = sparse.decode(content, plan.layout(n), what)
        out[...] = 0
        out[idx] = vals
        return
    nb = num_blocks(n, plan.block_size)
    mins = content[: 4 * nb].view("<f4")
    scales = content[4 * nb : 8 * nb].view("<f4")
    modes = content[8 * nb : 9 * nb]
    if not (np.isfinite(mins).all() and np.isfinite(scales).all() and (scales >= 0).all()):
        raise CodecError(f"{what}: block minima or scales are NaN, Inf or negative (corrupt payload)")
    if modes.max(initial=0) > 1:
        raise CodecError(f"{what}: a block's prediction mode is {int(modes.max())}, expected 0 or 1 (corrupt payload)")
    body = content[9 * nb :]
    levels = LEVELS[plan.codec]
    if plan.codec == "int16":
        q = _unplane(body, np.empty(n, "<u2"), (0, 1))
    elif plan.codec == "int4":
        q = np.empty(n, np.uint8)
        q[0::2] = body & 0x0F
        q[1::2] = body[: n // 2] >> 4
    elif plan.codec == "int2":
        q = np.empty(n, np.uint8)
        for i in range(4):
            q[i::4] = (body[: -(-(n - i) // 4)] >> (2 * i)) & 3
    else:
        q = body
    if modes.any():
        predict.undo(q, modes, plan.block_size, plan.row, levels)
    dequantize(q, mins, scales, plan.block_size, out)


def _check_finite(out: np.ndarray, what: str, start: int) -> None:
    if np.isfinite(out.min()) and np.isfinite(out.max()):
        return
    at = start + int(np.argmin(np.isfinite(out)))
    raise CodecError(f"{what}: decoded value at flat index {at} is NaN or Inf (corrupt payload)")
