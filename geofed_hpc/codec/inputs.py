"""Tensors to encode: numpy arrays or sources read piece by piece, checked and yielded as flat float32 pieces."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import xxhash

from geofed_hpc.errors import CodecError


@dataclass(frozen=True)
class TensorSource:
    """A tensor read in pieces, for deltas too large to hold at once: read(start, stop) -> flat float values."""

    shape: tuple[int, ...]
    read: Callable[[int, int], np.ndarray]


class Tensor:
    """One named input: its shape and its values as float32 pieces (NaN, Inf and bad types refused by name)."""

    def __init__(self, name: object, value: object) -> None:
        if not isinstance(name, str):
            raise CodecError(f"tensor names must be strings, got {name!r}")
        self.name = name
        if isinstance(value, TensorSource):
            self.shape = tuple(int(d) for d in value.shape)
            self._read = value.read
            self._array: np.ndarray | None = None
        else:
            if isinstance(value, np.generic):
                value = np.asarray(value)
            if not isinstance(value, np.ndarray):
                raise CodecError(f"tensor {name!r}: expected a numpy array, got {type(value).__name__}")
            self._check_dtype(value)
            self.shape = value.shape
            self._array = value
        self.numel = math.prod(self.shape)
        self.row = self.shape[-1] if len(self.shape) >= 2 else 0

    def _check_dtype(self, value: np.ndarray) -> None:
        if value.dtype.kind != "f":
            raise CodecError(f"tensor {self.name!r}: dtype {value.dtype} is not a floating dtype (float32 expected)")

    def piece(self, start: int, stop: int) -> np.ndarray:
        """Flat little-endian float32 values [start, stop), finite, checked."""
        if self._array is not None:
            a = self._array
            raw = a.reshape(-1)[start:stop] if a.flags.c_contiguous else np.asarray(a.flat[start:stop])
        else:
            raw = np.asarray(self._read(start, stop))
            self._check_dtype(raw)
            if raw.size != stop - start:
                raise CodecError(f"tensor {self.name!r}: source gave {raw.size} values for [{start}, {stop})")
            raw = raw.reshape(-1)
        with np.errstate(over="ignore"):  # float64 beyond float32 range becomes Inf, refused by the caller
            return raw.astype("<f4", copy=False)

    def refuse(self, piece: np.ndarray, start: int) -> None:
        """Raise CodecError at the first non-finite value of `piece` (which starts at flat index `start`)."""
        finite = np.isfinite(piece)
        at = int(np.argmin(finite)) if not finite.all() else 0
        raise CodecError(
            f"tensor {self.name!r}: value {piece[at]!r} at flat index {start + at} is NaN, Inf or beyond float32 "
            "range; refusing to encode it"
        )


def tensors_of(values: Mapping[str, object]) -> list[Tensor]:
    """Wrap every input, in order."""
    return [Tensor(name, value) for name, value in values.items()]


def pieces(t: Tensor, step: int) -> Iterator[tuple[int, np.ndarray]]:
    """(start, piece) over the whole tensor, `step` values at a time."""
    for start in range(0, t.numel, step):
        yield start, t.piece(start, min(t.numel, start + step))


def fingerprint(arrays: Mapping[str, np.ndarray]) -> str:
    """xxh3-128 over names, shapes and float32 bytes in name order: equal exactly when the tensors are bit-identical
    (a replica against the PS's model, say)."""
    h = xxhash.xxh3_128()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name], dtype="<f4")
        h.update(f"{name}{a.shape}".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()
