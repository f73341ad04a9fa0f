"""A dense tensor of a verified payload kept as its pieces' contents (no float32 copy) and decoded on demand."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from geofed_hpc.codec import schemes, sparse

# Codecs whose decoding rewrites the piece's content in place (the prediction modes are undone on the symbols):
# a kept content is copied before each decode, so it can be read again.
IN_PLACE = ("int8",)


@dataclass
class PackedPiece:
    """Values [start, start + n) of a tensor: the piece's content (codec symbols, scales) and its plan."""

    start: int
    n: int
    content: np.ndarray
    plan: schemes.Plan
    mean: np.ndarray | None = None  # the sparse codec's mean row, added back after decoding


@dataclass
class PackedTensor:
    """A dense tensor of `shape` held as its pieces' contents, a quarter of its float32 size for int8: decoded one
    piece at a time (`read`) exactly as the whole tensor decodes, times the factors `scale` recorded, in order.
    What a PS keeps of a push between its stream verifying and its fold (codec/stream.py decodes it once then, to
    check it and take its norm)."""

    shape: tuple[int, ...]
    pieces: list[PackedPiece]
    what: str
    sq: float = 0.0  # the sum of squares, taken when the payload was checked (float32 dots, summed per piece)
    factors: list[np.float32] = field(default_factory=list)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held (the contents)."""
        return sum(p.content.nbytes for p in self.pieces)

    def _decode(self, p: PackedPiece, out: np.ndarray) -> None:
        content = p.content.copy() if p.plan.codec in IN_PLACE else p.content
        schemes.decode(content, p.plan, out, self.what, p.start)
        if p.mean is not None:
            out += sparse.tile(p.mean, p.start, p.n)
        for f in self.factors:
            out *= f

    def read(self, start: int, stop: int) -> np.ndarray:
        """Values [start, stop) as a new flat float32 array."""
        out = np.empty(stop - start, np.float32)
        buf: np.ndarray | None = None
        for p in self.pieces:
            lo, hi = max(start, p.start), min(stop, p.start + p.n)
            if lo >= hi:
                continue
            if lo == p.start and hi == p.start + p.n:
                self._decode(p, out[lo - start : hi - start])
                continue
            if buf is None or buf.size < p.n:
                buf = np.empty(p.n, np.float32)
            self._decode(p, buf[: p.n])
            out[lo - start : hi - start] = buf[lo - p.start : hi - p.start]
        return out

    def dense(self) -> np.ndarray:
        """The whole tensor as a float32 array."""
        return self.read(0, self.size).reshape(self.shape)

    def scale(self, factor: np.float32) -> None:
        """self *= factor (applied to every value read from now on, after the factors before it)."""
        self.factors.append(np.float32(factor))

    def sq_norm(self) -> float:
        """Sum of squares as decoded (before any `scale`)."""
        return self.sq

    def add_into(self, target: np.ndarray, factor: np.float32 | float = 1.0) -> None:
        """target += factor * self, piece by piece, the same float32 operations as with the decoded tensor."""
        flat = target.reshape(-1)
        f = np.float32(factor)
        for p in self.pieces:
            v = self.read(p.start, p.start + p.n)
            if factor != 1:
                v *= f
            flat[p.start : p.start + p.n] += v
