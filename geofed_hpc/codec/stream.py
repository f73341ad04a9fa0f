"""The delta stream: a header frame, each tensor's pieces in ~1 MiB data frames, an end frame; bounded memory."""

# Header body: stream id (8 bytes) | JSON {"codec", "block_size", "piece", "tensors": [{"name", "shape"}],
#   "huffman": {"min", "scale", "lengths"} (paper_int8 only), "sparse": {"keep", "bits", "mean", "dense":
#   {"codec", "block_size", "below"}} (sparse only: values kept per chunk of block_size values, bits per kept
#   value, whether matrices send their mean row, and the min-max codec of tensors of fewer than `below` values;
#   a header with keep and bits alone is read as no mean rows and no dense tensors)}.
# Data body: stream id | tensor u32 | piece u32 | part u32 | last u8 | bytes of the piece's blob, where the
#   blob is the zstd frame of the piece's content (schemes.py; a sparse matrix's first piece starts with its
#   mean row, float32), or for paper_int8 the huffman blob itself.
# End body: stream id | frames before it u64 | values u64.
# A piece is `piece` values (a whole number of blocks, about 64 MiB of float32); each is encoded, framed and
# decoded on its own, so memory stays at a few pieces whatever the model size.

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from geofed_hpc.codec import frames, huffman, schemes, sparse
from geofed_hpc.codec.frames import DATA, END, HEADER, FrameReader
from geofed_hpc.codec.inputs import Tensor, pieces, tensors_of
from geofed_hpc.codec.packed import IN_PLACE, PackedPiece, PackedTensor
from geofed_hpc.codec.quant import block_minmax, block_scales, num_blocks
from geofed_hpc.codec.sparse import SparseTensor
from geofed_hpc.codec.zstdio import Inflater, compress_parts, compressor, decompressor
from geofed_hpc.config import WIRE_CODECS, CodecConfig
from geofed_hpc.errors import CodecError
from geofed_hpc.log import logger

PIECE = 1 << 24  # values per piece (64 MiB of float32)
FRAME = 1 << 20  # bytes of blob per data frame
_DATA = struct.Struct("<8sIIIB")
_END = struct.Struct("<8sQQ")
_MAX_NDIM = 32
_MAX_NUMEL = 1 << 40
_MAX_BLOCK = 1 << 31
_MAX_PIECE = 1 << 28
_F32_HALF = float(np.finfo(np.float32).max) / 2

Expected = Mapping[str, tuple[tuple[int, ...], str]]


def piece_len(block_size: int) -> int:
    """Values per piece for `block_size`: a whole number of blocks, about PIECE values."""
    return max(block_size, PIECE // block_size * block_size)


# ------------------------------------------------------------------------------------------------ encode


Bounds = dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]
_MAX_CACHED_BLOCKS = 1 << 20  # per-block min/max kept from the first pass up to this many blocks (8 MiB)


def _scan(ts: list[Tensor], step: int, block_size: int) -> tuple[float, float, Bounds]:
    """Min and max over every value, and per-piece block minima and maxima while they are few (a first pass).

    CodecError names the tensor at a NaN or Inf.
    """
    keep = sum(num_blocks(t.numel, block_size) for t in ts) <= _MAX_CACHED_BLOCKS
    lo, hi = math.inf, -math.inf
    bounds: Bounds = {}
    for ti, t in enumerate(ts):
        for pi, (start, x) in enumerate(pieces(t, step)):
            mins, maxs = block_minmax(x, block_size)
            a, b = float(mins.min()), float(maxs.max())
            if not (math.isfinite(a) and math.isfinite(b)):
                t.refuse(x, start)
            lo, hi = min(lo, a), max(hi, b)
            if keep:
                bounds[ti, pi] = (mins, maxs)
            del x
    return (lo, hi, bounds) if lo <= hi else (0.0, 0.0, bounds)


def block_of(cfg: CodecConfig) -> int:
    """The stream's block: codec.chunk for sparse, codec.block_size for the others."""
    return cfg.chunk if cfg.name == "sparse" else cfg.block_size


def _mean_row(t: Tensor, step: int) -> np.ndarray:
    """The mean of a tensor's rows (shape[-1] values each), float32: a first pass over its pieces, which refuses a
    NaN or Inf before anything of the tensor is encoded."""
    sums = np.zeros(t.row, np.float64)
    peak = 0.0
    for start, x in pieces(t, step):
        lo, hi = x.min(), x.max()
        if not (np.isfinite(lo) and np.isfinite(hi)):
            t.refuse(x, start)
        peak = max(peak, -float(lo), float(hi))
        sparse.column_sums(x, start, t.row, sums)
    if peak >= _F32_HALF:  # value - mean could overflow float32: send a zero row (top-k of the values themselves)
        return np.zeros(t.row, np.float32)
    return (sums / (t.numel // t.row)).astype(np.float32)


def _plan(ts: list[Tensor], cfg: CodecConfig, step: int) -> tuple[schemes.Plan, dict[str, Any], Bounds]:
    """The payload-wide plan (a first pass over the values where the codec needs one) and its header fields."""
    rng = np.random.default_rng() if cfg.stochastic_rounding else None
    plan = schemes.Plan(cfg.name, block_of(cfg), rng=rng)
    if cfg.name == "sparse":
        plan.keep, plan.value_bits = sparse.keep_of(cfg.chunk, cfg.density), cfg.value_bits
        plan.mean_row, plan.dense_below = cfg.mean_row, cfg.dense_below
        plan.dense_codec, plan.dense_block = cfg.dense_codec, cfg.block_size
        dense = {"codec": cfg.dense_codec, "block_size": cfg.block_size, "below": cfg.dense_below}
        extra = {"keep": plan.keep, "bits": plan.value_bits, "mean": cfg.mean_row, "dense": dense}
        small = [t for t in ts if plan.for_tensor(t.shape).codec != "sparse"]
        if small:  # the small tensors' min-max range, as for a payload of them alone
            lo, hi, _ = _scan(small, step, cfg.block_size)
            plan.global_range = hi - lo
        return plan, {"sparse": extra}, {}
    if cfg.name not in schemes.MINMAX and cfg.name != "paper_int8":
        return plan, {}, {}
    lo, hi, bounds = _scan(ts, step, cfg.block_size if cfg.name in schemes.MINMAX else step)
    plan.global_range = hi - lo
    if cfg.name != "paper_int8":
        return plan, {}, bounds
    plan.rng = None
    plan.paper_min = float(np.float32(lo))
    plan.paper_scale = float(
        block_scales(np.array([lo], np.float32), np.array([hi], np.float32), 255, plan.global_range)[0]
    )
    counts = np.zeros(256, np.int64)
    for t in ts:
        for _, x in pieces(t, step):
            counts += np.bincount(schemes.paper_symbols(x, plan), minlength=256)
    if not counts.any():
        counts[0] = 1
    plan.lengths = huffman.code_lengths(counts)
    extra = {"min": plan.paper_min, "scale": plan.paper_scale, "lengths": plan.lengths.tolist()}
    return plan, {"huffman": extra}, {}


def _frame_parts(
    tensors: Mapping[str, Any],
    cfg: CodecConfig,
    residual: MutableMapping[str, np.ndarray] | None = None,
    frame_bytes: int = 0,
) -> Iterator[list[bytes | memoryview]]:
    """encode_frames, with each frame as the list of byte strings it joins (so encode copies once)."""
    if cfg.name not in WIRE_CODECS:
        raise CodecError(f"codec.name: {cfg.name!r} is not a wire codec; encode with one of {', '.join(WIRE_CODECS)}")
    ts = tensors_of(tensors)
    step = piece_len(block_of(cfg))
    plan, extra, bounds = _plan(ts, cfg, step)
    cctx = compressor(cfg.zstd_level)
    sid = os.urandom(8)
    header = {
        "codec": cfg.name,
        "block_size": block_of(cfg),
        "piece": step,
        "tensors": [{"name": t.name, "shape": list(t.shape)} for t in ts],
        **extra,
    }
    yield frames.pieces(HEADER, sid + json.dumps(header, separators=(",", ":")).encode())
    count, total = 1, 0
    for ti, t in enumerate(ts):
        res = None
        if residual is not None:
            res = residual[t.name] = np.empty(t.shape, np.float32)
        tplan = plan.for_tensor(t.shape, plan.global_range)
        mean = _mean_row(t, step) if plan.has_mean(t.shape) else None
        for pi, (start, x) in enumerate(pieces(t, step)):
            if cfg.name in ("fp32", "bf16", "sparse") and not (np.isfinite(x.min()) and np.isfinite(x.max())):
                t.refuse(x, start)
            recon = np.empty(x.size, np.float32) if res is not None else None
            if mean is None:
                content = schemes.encode(x, tplan, recon, bounds.pop((ti, pi), None))
            else:  # top-k of what the mean row leaves; decoding adds it back (0 + mean where nothing is kept)
                shift = sparse.tile(mean, start, x.size)
                content = schemes.encode(x - shift, tplan, recon)
                if recon is not None:
                    recon += shift
                if pi == 0:
                    content = [mean.view(np.uint8), *content]
                del shift
            if res is not None and recon is not None:
                np.subtract(x, recon, out=res.reshape(-1)[start : start + x.size])
            parts = content if cfg.name == "paper_int8" else compress_parts(cctx, content)
            total += x.size
            del x, recon, content  # memory stays at a few pieces: drop this one before the next is read
            for k, (blob, last) in enumerate(_split(parts, frame_bytes or FRAME)):
                yield frames.pieces(DATA, _DATA.pack(sid, ti, pi, k, last), *blob)
                count += 1
    yield frames.pieces(END, _END.pack(sid, count, total))


def _split(parts: Iterable[Any], size: int) -> Iterator[tuple[list[memoryview], bool]]:
    """Re-cut a stream of byte parts into groups of `size` bytes (the last may be shorter), flagging the last."""
    group: list[memoryview] = []
    have = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while have + len(view) > size:
            take = size - have
            yield [*group, view[:take]], False
            group, have, view = [], 0, view[take:]
        if len(view):
            group.append(view)
            have += len(view)
    yield group, True


def encode_frames(
    tensors: Mapping[str, Any],
    cfg: CodecConfig,
    residual: MutableMapping[str, np.ndarray] | None = None,
    frame_bytes: int = 0,
) -> Iterator[bytes]:
    """Frames of the encoded tensors (arrays or TensorSources), produced piece by piece.

    Data frames carry `frame_bytes` (default FRAME) of blob each. With `residual`, each tensor's quantization
    error (value - decoded value, float32, its shape) is stored there under its name. CodecError names a tensor
    that is not float, holds NaN/Inf or is otherwise unusable.
    """
    for parts in _frame_parts(tensors, cfg, residual, frame_bytes):
        yield b"".join(parts)


def encode(
    tensors: Mapping[str, Any], cfg: CodecConfig, residual: MutableMapping[str, np.ndarray] | None = None
) -> bytes:
    """The whole stream as one bytes object (see encode_frames)."""
    out = b"".join(itertools.chain.from_iterable(_frame_parts(tensors, cfg, residual)))
    logger.debug("codec %s: %d tensors -> %d bytes", cfg.name, len(tensors), len(out))
    return out


# ------------------------------------------------------------------------------------------------ decode


@dataclass(frozen=True)
class Header:
    codec: str
    block_size: int
    piece: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    plan: schemes.Plan


@dataclass(frozen=True)
class Piece:
    """Decoded values [start, start + len(values)) of tensor `name`; or, from a sparse decoder, the piece's kept
    `values` at flat tensor `indices`."""

    name: str
    shape: tuple[int, ...]
    start: int
    values: np.ndarray
    indices: np.ndarray | None = None
    mean: np.ndarray | None = None  # sparse, first piece of a matrix: its mean row
    packed: PackedPiece | None = None  # from a packing decoder: the piece's content, kept (`values` checked it)


def _is_int(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _parse_header(body: memoryview) -> tuple[bytes, Header]:
    sid = bytes(body[:8])
    try:
        raw = json.loads(bytes(body[8:]))
    except (ValueError, RecursionError) as exc:
        raise CodecError(f"header: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CodecError(f"header: expected a JSON object, got {type(raw).__name__}")
    codec = raw.get("codec")
    extra = {"paper_int8": {"huffman"}, "sparse": {"sparse"}}.get(codec, set()) if isinstance(codec, str) else set()
    keys = {"codec", "block_size", "piece", "tensors"} | extra
    if set(raw) != keys:
        raise CodecError(f"header: expected keys {', '.join(sorted(keys))}; got {', '.join(sorted(raw))}")
    if codec not in WIRE_CODECS:
        raise CodecError(f"header: codec {codec!r:.100} is unknown; expected one of {', '.join(WIRE_CODECS)}")
    block_size, piece, tensors = raw["block_size"], raw["piece"], raw["tensors"]
    if not _is_int(block_size, 1, _MAX_BLOCK):
        raise CodecError(f"header: block_size must be an integer in 1..{_MAX_BLOCK}, got {block_size!r:.100}")
    if not (_is_int(piece, block_size, max(block_size, _MAX_PIECE)) and piece % block_size == 0):
        raise CodecError(f"header: piece must be a multiple of block_size up to {_MAX_PIECE}, got {piece!r:.100}")
    if not isinstance(tensors, list):
        raise CodecError(f"header: tensors must be a list, got {type(tensors).__name__}")
    names, shapes = [], []
    for i, entry in enumerate(tensors):
        name, shape = _parse_entry(entry, i)
        if name in names:
            raise CodecError(f"header: tensor {name!r} appears more than once")
        names.append(name)
        shapes.append(shape)
    plan = schemes.Plan(codec, block_size)
    if codec == "paper_int8":
        h = raw["huffman"]
        if not (isinstance(h, dict) and set(h) == {"min", "scale", "lengths"}):
            raise CodecError("header: huffman must be an object with keys lengths, min, scale")
        if not all(type(h[k]) in (int, float) and math.isfinite(h[k]) for k in ("min", "scale")) or h["scale"] < 0:
            raise CodecError("header: huffman.min and huffman.scale must be finite numbers (scale >= 0)")
        plan.paper_min, plan.paper_scale = float(h["min"]), float(h["scale"])
        plan.lengths = huffman.check_lengths(h["lengths"])
    if codec == "sparse":
        _parse_sparse(raw["sparse"], plan)
    return sid, Header(codec, block_size, piece, names, shapes, plan)


_SPARSE_KEYS = ({"keep", "bits"}, {"keep", "bits", "mean", "dense"})
_MAX_DENSE_BELOW = 1 << 24  # codec.dense_below's bound


def _parse_sparse(raw: object, plan: schemes.Plan) -> None:
    """Fill the sparse fields of `plan` from the header's "sparse" object (checked)."""
    if not (isinstance(raw, dict) and set(raw) in _SPARSE_KEYS):
        raise CodecError("header: sparse must be an object with keys bits, keep (and dense, mean)")
    chunk, keep, bits = plan.block_size, raw["keep"], raw["bits"]
    if chunk > sparse.MAX_CHUNK:
        raise CodecError(f"header: a sparse chunk (block_size) is at most {sparse.MAX_CHUNK} values, got {chunk}")
    if not _is_int(keep, 1, chunk):
        raise CodecError(f"header: sparse.keep must be 1..{chunk} (the chunk's values), got {keep!r:.100}")
    if not _is_int(bits, 1, 4):
        raise CodecError(f"header: sparse.bits must be 1..4, got {bits!r:.100}")
    plan.keep, plan.value_bits = keep, bits
    if "mean" not in raw:
        return
    mean, dense = raw["mean"], raw["dense"]
    if not isinstance(mean, bool):
        raise CodecError(f"header: sparse.mean must be true or false, got {mean!r:.100}")
    if not (isinstance(dense, dict) and set(dense) == {"codec", "block_size", "below"}):
        raise CodecError("header: sparse.dense must be an object with keys below, block_size, codec")
    if dense["codec"] not in schemes.MINMAX:
        raise CodecError(
            f"header: sparse.dense.codec must be one of {', '.join(schemes.MINMAX)}, got {dense['codec']!r:.100}"
        )
    if not _is_int(dense["block_size"], 1, _MAX_BLOCK):
        raise CodecError(f"header: sparse.dense.block_size must be 1..{_MAX_BLOCK}, got {dense['block_size']!r:.100}")
    if not _is_int(dense["below"], 0, _MAX_DENSE_BELOW):
        raise CodecError(f"header: sparse.dense.below must be 0..{_MAX_DENSE_BELOW}, got {dense['below']!r:.100}")
    plan.mean_row = mean
    plan.dense_codec, plan.dense_block, plan.dense_below = dense["codec"], dense["block_size"], dense["below"]


def _parse_entry(raw: object, index: int) -> tuple[str, tuple[int, ...]]:
    where = f"header: tensors[{index}]"
    if not isinstance(raw, dict) or set(raw) != {"name", "shape"}:
        raise CodecError(f"{where}: expected an object with keys name, shape; got {raw!r:.200}")
    name, shape = raw["name"], raw["shape"]
    if not isinstance(name, str):
        raise CodecError(f"{where}: name must be a string, got {name!r:.100}")
    if not (isinstance(shape, list) and len(shape) <= _MAX_NDIM and all(_is_int(d, 0, _MAX_NUMEL) for d in shape)):
        raise CodecError(f"header: tensor {name!r}: shape must be a list of at most {_MAX_NDIM} sizes >= 0")
    if math.prod(shape) > _MAX_NUMEL:
        raise CodecError(f"header: tensor {name!r}: shape {shape} has more than {_MAX_NUMEL} elements")
    return name, tuple(shape)


def _check_expected(h: Header, expected: Expected) -> None:
    got = dict(zip(h.names, h.shapes, strict=True))
    missing = [repr(n) for n in expected if n not in got]
    extra = [repr(n) for n in got if n not in expected]
    mismatched = [
        f"{name!r} is {list(got[name])} float32, expected {list(shape)} {dtype}"
        for name, (shape, dtype) in expected.items()
        if name in got and (got[name] != tuple(shape) or dtype != "float32")
    ]
    problems = [f"{label}: {', '.join(items)}" for label, items in (("missing", missing), ("extra", extra),
                ("mismatched", mismatched)) if items]  # fmt: skip
    if problems:
        raise CodecError("payload does not hold the expected tensors; " + "; ".join(problems))


Target = Callable[[str, tuple[int, ...], int, int], np.ndarray]


class Scratch:
    """Buffers one decoder reuses from payload to payload: the decoded tensors (not with `packed`), a piece's content
    and values and a zstd decompressor. Writing to fresh pages costs more than decoding into them, and concurrent
    threads faulting pages in contend in the kernel; reused buffers avoid both. A tensor decoded into a Scratch is
    valid until its next payload."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._content = np.empty(0, np.uint8)
        self._piece = np.empty(0, np.float32)
        self.dctx = decompressor()

    def array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        a = self._arrays.get(name)
        if a is None or a.shape != shape:
            a = self._arrays[name] = _alloc(shape, f"tensor {name!r}")
        return a

    def content(self, size: int) -> np.ndarray:
        if self._content.size < size:
            self._content = np.empty(size, np.uint8)
        return self._content[:size]

    def piece(self, n: int) -> np.ndarray:
        """A float32 buffer of n values (a piece's), reused."""
        if self._piece.size < n:
            self._piece = np.empty(n, np.float32)
        return self._piece[:n]

    def keep_only(self, names: Iterable[str]) -> None:
        """Drop the buffers of tensors the last payload did not hold."""
        keep = set(names)
        self._arrays = {k: v for k, v in self._arrays.items() if k in keep}


class StreamDecoder:
    """Decodes a stream from byte chunks of any size, piece by piece; `header` is set once it is read. With
    `sparse`, pieces of a sparse payload come as kept indices and values (never densified); with `scratch`, piece
    contents are decoded in its reused buffer. With `packed`, each dense piece also keeps its content (`Piece.packed`,
    in a buffer of its own) to be decoded again later; its `values` are then a reused buffer, valid until the next."""

    def __init__(
        self,
        expected: Expected | None = None,
        sparse: bool = False,
        scratch: Scratch | None = None,
        packed: bool = False,
    ) -> None:
        self.expected = expected
        self.sparse = sparse
        self.scratch = scratch
        self.packed = packed
        self.header: Header | None = None
        self._mean: np.ndarray | None = None  # the mean row of the sparse matrix being decoded

    def pieces(self, chunks: Iterable[object], target: Target | None = None) -> Iterator[Piece]:
        """Each decoded piece in order; `target(name, shape, start, n)` may supply the float32 array to fill."""
        reader = FrameReader(chunks)
        first = reader.next()
        if first is None:
            raise CodecError("payload truncated: it is empty (no header frame)")
        if first.kind != HEADER:
            raise CodecError(f"frame 0: expected the header frame, got a {frames.KINDS[first.kind]} frame")
        sid, h = _parse_header(first.body)
        if self.expected is not None:
            _check_expected(h, self.expected)
        self.header = h
        total = 0
        for ti, (name, shape) in enumerate(zip(h.names, h.shapes, strict=True)):
            numel = math.prod(shape)
            plan = h.plan.for_tensor(shape)
            self._mean = None
            for pi, start in enumerate(range(0, numel, h.piece)):
                n = min(h.piece, numel - start)
                total += n
                if self.sparse and plan.codec == "sparse":
                    idx, vals = self._piece(reader, sid, h, plan, ti, pi, start, n, None)
                    idx += start
                    yield Piece(name, shape, start, vals, idx, self._mean if pi == 0 else None)
                    continue
                if self.packed:
                    out = self.scratch.piece(n) if self.scratch is not None else np.empty(n, np.float32)
                    kept = self._piece(reader, sid, h, plan, ti, pi, start, n, out, keep=True)
                    yield Piece(name, shape, start, out, packed=kept)
                    continue
                out = target(name, shape, start, n) if target else np.empty(n, np.float32)
                self._piece(reader, sid, h, plan, ti, pi, start, n, out)
                yield Piece(name, shape, start, out)
                del out  # the caller holds it if it wants it
        end = reader.next()
        if end is None or end.kind != END:
            got = "the end of the payload" if end is None else f"a {frames.KINDS[end.kind]} frame"
            raise CodecError(f"frame {reader.index}: expected the end frame, got {got} (truncated or corrupt)")
        e_sid, e_count, e_total = _END.unpack(end.body) if len(end.body) == _END.size else (b"", -1, -1)
        if e_sid != sid or e_count != end.index or e_total != total:
            raise CodecError(f"frame {end.index}: end frame does not match the stream (another payload's, or corrupt)")
        if reader.next() is not None:
            raise CodecError(f"payload: trailing frame after the end frame at byte {reader.offset}")

    def _piece(
        self,
        reader: FrameReader,
        sid: bytes,
        h: Header,
        plan: schemes.Plan,
        ti: int,
        pi: int,
        start: int,
        n: int,
        out: np.ndarray | None,
        keep: bool = False,
    ) -> Any:
        """Read a piece's frames and decode it (with `plan`, the tensor's) into `out`; without `out` (sparse only)
        return its kept offsets within the piece and values; with `keep`, return its content (a PackedPiece, in a
        buffer of its own) too. A sparse matrix's mean row, which its first piece starts with, is kept in
        `_mean`."""
        name = h.names[ti]
        what = f"tensor {name!r}"
        raw = h.codec == "paper_int8"
        head = 4 * h.shapes[ti][-1] if pi == 0 and h.plan.has_mean(h.shapes[ti]) else 0
        if raw:
            limit = 2 * -(-n // huffman.SEGMENT) + -(-n * huffman.MAX_LEN // 8)
            blob = bytearray()
        else:
            size = head + schemes.content_size(plan, n)
            fresh = keep or self.scratch is None
            content = np.empty(size, np.uint8) if fresh else self.scratch.content(size)  # type: ignore[union-attr]
            sink = Inflater(content, what, self.scratch.dctx if self.scratch is not None else None)
        for k in range(1 << 32):
            try:
                frame = reader.next()
            except CodecError as exc:
                raise CodecError(f"{what} piece {pi}: {exc}") from None
            if frame is None:
                raise CodecError(f"payload truncated: {what} piece {pi} part {k} never arrived")
            if frame.kind != DATA or len(frame.body) < _DATA.size:
                got = frames.KINDS[frame.kind]
                raise CodecError(f"frame {frame.index}: expected data of {what} piece {pi}, got a {got} frame")
            f_sid, f_t, f_p, f_k, last = _DATA.unpack_from(frame.body)
            if f_sid != sid:
                raise CodecError(f"frame {frame.index}: belongs to another payload (stream id differs); {what}")
            if (f_t, f_p, f_k) != (ti, pi, k) or last > 1:
                raise CodecError(
                    f"frame {frame.index}: expected {what} piece {pi} part {k}, got tensor #{f_t} piece {f_p} "
                    f"part {f_k} (frames lost, reordered or corrupt)"
                )
            data = frame.body[_DATA.size :]
            if raw:
                if len(blob) + len(data) > limit:
                    raise CodecError(f"{what}: piece {pi} is longer than {n} huffman codes can be")
                blob += data
            else:
                sink.feed(data)
            if last:
                break
        if raw:
            content = np.frombuffer(bytes(blob), np.uint8)
        else:
            sink.finish()
        if head:
            self._mean = content[:head].view("<f4").copy()
            if not np.isfinite(self._mean).all():
                raise CodecError(f"{what}: its mean row holds NaN or Inf (corrupt payload)")
            content = content[head:]
        if out is None:
            return sparse.decode(content, plan.layout(n), what)
        kept = PackedPiece(start, n, content, plan, self._mean) if keep else None
        if keep and plan.codec in IN_PLACE:
            content = content.copy()  # decoding undoes the prediction in place: the kept content stays as sent
        schemes.decode(content, plan, out, what, start)
        if self._mean is not None:
            out += sparse.tile(self._mean, start, n)
        return kept if keep else _NOTHING


_NOTHING = (np.zeros(0, np.int64), np.zeros(0, np.float32))


def _alloc(shape: tuple[int, ...], what: str) -> np.ndarray:
    try:
        return np.empty(shape, np.float32)
    except (MemoryError, ValueError) as exc:
        raise CodecError(f"{what}: cannot allocate {math.prod(shape)} float32 values ({exc})") from exc


def decode(payload: object, expected: Expected | None = None) -> dict[str, np.ndarray]:
    """Float32 tensors of a payload (bytes, or an iterable of byte chunks), in encoded order.

    With `expected` (name -> (shape, dtype)) names and shapes must match before anything is allocated: pass it
    whenever the payload comes from an untrusted peer. Every malformed input raises CodecError.
    """
    chunks = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
    if not isinstance(chunks, Iterable) or isinstance(payload, str):
        raise CodecError(f"payload: expected bytes, got {type(payload).__name__}")
    arrays: dict[str, np.ndarray] = {}

    def target(name: str, shape: tuple[int, ...], start: int, n: int) -> np.ndarray:
        if name not in arrays:
            arrays[name] = _alloc(shape, f"tensor {name!r}")
        return arrays[name].reshape(-1)[start : start + n]

    dec = StreamDecoder(expected)
    for _ in dec.pieces(chunks, target):
        pass
    assert dec.header is not None
    return {
        n: arrays[n] if n in arrays else np.zeros(s, np.float32)
        for n, s in zip(dec.header.names, dec.header.shapes, strict=True)
    }


def decode_sparse(payload: object, expected: Expected | None = None) -> dict[str, np.ndarray | SparseTensor]:
    """As `decode`, but the tensors of a sparse payload come as SparseTensors (kept indices and values, never
    densified); other payloads decode as `decode` gives them."""
    return decode_stream(payload, expected, sparse=True)[1]


def decode_stream(
    payload: object,
    expected: Expected | None = None,
    sparse: bool = False,
    scratch: Scratch | None = None,
    packed: bool = False,
) -> tuple[str, dict[str, Any]]:
    """(codec, tensors) of a payload read to its end (bytes or byte chunks as they arrive); with `sparse` as
    `decode_sparse` gives them, else dense; with `scratch`, dense tensors are its reused buffers; with `packed`,
    dense tensors come as PackedTensors (their pieces' contents, checked by decoding each once, piece by piece into
    the scratch's piece buffer: no float32 copy of the payload is ever made)."""
    chunks = _chunks_of(payload)
    dec = StreamDecoder(expected, sparse=sparse, scratch=scratch, packed=packed)
    parts: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    means: dict[str, np.ndarray] = {}
    dense: dict[str, np.ndarray] = {}
    packs: dict[str, PackedTensor] = {}

    def target(name: str, shape: tuple[int, ...], start: int, n: int) -> np.ndarray:
        if name not in dense:
            dense[name] = scratch.array(name, shape) if scratch is not None else _alloc(shape, f"tensor {name!r}")
        return dense[name].reshape(-1)[start : start + n]

    for piece in dec.pieces(chunks, target):
        if piece.packed is not None:
            t = packs.setdefault(piece.name, PackedTensor(piece.shape, [], f"tensor {piece.name!r}"))
            t.pieces.append(piece.packed)
            t.sq += float(np.dot(piece.values, piece.values)) if piece.values.size else 0.0
            continue
        if piece.indices is not None:
            idx, vals = parts.setdefault(piece.name, ([], []))
            idx.append(piece.indices)
            vals.append(piece.values)
            if piece.mean is not None:
                means[piece.name] = piece.mean
    assert dec.header is not None
    if scratch is not None and dense:
        scratch.keep_only(dense)
    out: dict[str, Any] = {}
    for name, shape in zip(dec.header.names, dec.header.shapes, strict=True):
        if name in packs:
            out[name] = packs[name]
        elif name in parts or (sparse and dec.header.plan.for_tensor(shape).codec == "sparse"):
            idx, vals = parts.get(name, ([], []))
            kept, values = (np.concatenate(idx), np.concatenate(vals)) if idx else _NOTHING
            out[name] = SparseTensor(shape, kept, values, means.get(name))
        else:
            out[name] = dense[name] if name in dense else np.zeros(shape, np.float32)  # (empty tensors)
    return dec.header.codec, out


def _chunks_of(payload: object) -> Iterable[object]:
    chunks = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
    if not isinstance(chunks, Iterable) or isinstance(payload, str):
        raise CodecError(f"payload: expected bytes, got {type(payload).__name__}")
    return chunks


def codec_name(payload: object) -> str:
    """The codec a payload was encoded with, read from its (checked) header frame alone."""
    chunks = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
    if not isinstance(chunks, Iterable) or isinstance(payload, str):
        raise CodecError(f"payload: expected bytes, got {type(payload).__name__}")
    first = FrameReader(chunks).next()
    if first is None or first.kind != HEADER:
        raise CodecError("payload: does not start with a header frame")
    return _parse_header(first.body)[1].codec
