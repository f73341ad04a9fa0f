"""Per-block min-max uint8 quantization of flat float32 pieces (pure numpy)."""

from __future__ import annotations

from typing import Any

import numpy as np

LEVELS = 255
# Above this magnitude float32 intermediates (x - min, min + q * scale) may overflow: work in float64 instead.
_WIDE = 1e38
_F32_MAX = float(np.finfo(np.float32).max)


def num_blocks(numel: int, block_size: int) -> int:
    """How many blocks of `block_size` elements cover `numel` elements (the last one may be short)."""
    return -(-numel // block_size)


def block_params(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-block float32 minimum and scale = (max - min) / 255 of flat finite float32 `x` (scale 0: constant)."""
    nb = num_blocks(x.size, block_size)
    mins = np.empty(nb, np.float32)
    maxs = np.empty(nb, np.float32)
    full = (x.size // block_size) * block_size
    if full:
        blocks = x[:full].reshape(-1, block_size)
        blocks.min(axis=1, out=mins[: full // block_size])
        blocks.max(axis=1, out=maxs[: full // block_size])
    if full < x.size:
        mins[-1] = x[full:].min()
        maxs[-1] = x[full:].max()
    # The range is taken in float64: max - min of two float32 values can overflow float32, range / 255 cannot.
    scales = ((maxs.astype(np.float64) - mins) / LEVELS).astype(np.float32)
    return mins, scales


def _is_wide(mins: np.ndarray, scales: np.ndarray) -> bool:
    return bool(np.any(np.abs(mins.astype(np.float64)) + LEVELS * scales.astype(np.float64) > _WIDE))


def _rows(a: np.ndarray, block_size: int) -> list[tuple[np.ndarray, slice]]:
    """Split a flat piece into its full blocks (2-D view) and its short tail block (1-row view)."""
    full = (a.size // block_size) * block_size
    parts = []
    if full:
        parts.append((a[:full].reshape(-1, block_size), slice(0, full // block_size)))
    if full < a.size:
        parts.append((a[full:].reshape(1, -1), slice(full // block_size, full // block_size + 1)))
    return parts


def quantize(x: np.ndarray, mins: np.ndarray, scales: np.ndarray, block_size: int) -> np.ndarray:
    """q = round((x - min) / scale) per block as uint8; `x` starts at a block boundary."""
    work: type[np.floating[Any]] = np.float64 if _is_wide(mins, scales) else np.float32
    q = np.empty(x.size, np.uint8)
    for (xb, rows), (qb, _) in zip(_rows(x, block_size), _rows(q, block_size), strict=True):
        lo = mins[rows, None].astype(work)
        div = np.where(scales[rows] > 0, scales[rows], 1).astype(work)[:, None]
        t = xb.astype(work)
        t -= lo
        t /= div
        np.rint(t, out=t)
        np.clip(t, 0, LEVELS, out=t)
        qb[...] = t
    return q


def dequantize(q: np.ndarray, mins: np.ndarray, scales: np.ndarray, block_size: int, out: np.ndarray) -> None:
    """Write min + q * scale per block into float32 `out` (same length as `q`, starting at a block boundary)."""
    wide = _is_wide(mins, scales)
    work: type[np.floating[Any]] = np.float64 if wide else np.float32
    for (qb, rows), (ob, _) in zip(_rows(q, block_size), _rows(out, block_size), strict=True):
        t = qb.astype(work)
        t *= scales[rows, None].astype(work)
        t += mins[rows, None].astype(work)
        if wide:
            np.clip(t, -_F32_MAX, _F32_MAX, out=t)
        ob[...] = t
