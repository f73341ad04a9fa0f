"""Per-block min-max quantization of flat float32 pieces to 4, 8 or 16-bit symbols (pure numpy)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

SCRATCH = 1 << 20  # values of float scratch per step: quantizing never holds more than this in temporaries

# Above this magnitude float32 intermediates (x - min, min + q * scale) may overflow: work in float64 instead.
_WIDE = 1e38
_F32_MAX = float(np.finfo(np.float32).max)
_TINY_STEP = 1e-37  # 1 / step must stay a finite float32


def num_blocks(numel: int, block_size: int) -> int:
    """How many blocks of `block_size` elements cover `numel` elements (the last one may be short)."""
    return -(-numel // block_size)


def _rows(a: np.ndarray, block_size: int) -> list[tuple[np.ndarray, slice]]:
    """Split a flat piece into its full blocks (2-D view) and its short tail block (1-row view)."""
    full = (a.size // block_size) * block_size
    parts = []
    if full:
        parts.append((a[:full].reshape(-1, block_size), slice(0, full // block_size)))
    if full < a.size:
        parts.append((a[full:].reshape(1, -1), slice(full // block_size, full // block_size + 1)))
    return parts


def segments(numel: int, block_size: int, target: int = SCRATCH) -> Iterator[tuple[slice, slice, int]]:
    """(elements, blocks, width) spans of about `target` elements: whole blocks as rows of `width`, or part of one."""
    full = numel // block_size * block_size
    if block_size <= target:
        k = target // block_size * block_size
        for start in range(0, full, k):
            stop = min(full, start + k)
            yield slice(start, stop), slice(start // block_size, stop // block_size), block_size
        if full < numel:
            yield slice(full, numel), slice(full // block_size, full // block_size + 1), numel - full
        return
    for b in range(num_blocks(numel, block_size)):
        end = min(numel, (b + 1) * block_size)
        for start in range(b * block_size, end, target):
            stop = min(end, start + target)
            yield slice(start, stop), slice(b, b + 1), stop - start


def block_minmax(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-block float32 minimum and maximum of flat float32 `x`."""
    nb = num_blocks(x.size, block_size)
    mins = np.empty(nb, np.float32)
    maxs = np.empty(nb, np.float32)
    for xb, rows in _rows(x, block_size):
        xb.min(axis=1, out=mins[rows])
        xb.max(axis=1, out=maxs[rows])
    return mins, maxs


def block_scales(mins: np.ndarray, maxs: np.ndarray, levels: int, global_range: float) -> np.ndarray:
    """Float32 step per block: never finer than needed, never coarser than the global step.

    A block spanning the whole `global_range` gets `levels` steps (the paper's global min-max); a narrower
    block gets only as many levels as it needs to keep its step at or below global_range / levels, so every
    block's error is bounded by the global step while narrow blocks cost fewer bits. Constant blocks: 0.
    """
    spans = maxs.astype(np.float64) - mins  # float64: max - min of two float32 values can overflow float32
    if global_range > 0:
        used = np.clip(np.ceil(spans / global_range * levels), 1, levels)
    else:
        used = np.ones_like(spans)
    used[spans == global_range] = levels
    exact = spans / used
    scales = exact.astype(np.float32)
    low = scales < exact  # round up: `used` steps must cover the span (matters for tiny, subnormal steps)
    scales[low] = np.nextafter(scales[low], np.float32(np.inf))
    return scales


def _is_wide(mins: np.ndarray, scales: np.ndarray, levels: int) -> bool:
    """Whether float32 arithmetic could overflow: values near the float32 limit, or a step so small (subnormal)
    that its inverse is beyond float32."""
    big = np.any(np.abs(mins.astype(np.float64)) + levels * scales.astype(np.float64) > _WIDE)
    return bool(big or np.any((scales > 0) & (scales < _TINY_STEP)))


def quantize(
    x: np.ndarray,
    mins: np.ndarray,
    scales: np.ndarray,
    block_size: int,
    levels: int,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """q = round((x - min) / scale) per block, as uint8 (levels < 256) or uint16; `x` starts at a block boundary.

    With `rng`, rounding is stochastic (floor of t + U[0, 1)): unbiased, error below one step.
    """
    wide = _is_wide(mins, scales, levels)
    work: type[np.floating[Any]] = np.float64 if wide else np.float32
    q = np.empty(x.size, np.uint8 if levels < 256 else np.uint16)
    inv = np.divide(1.0, scales.astype(np.float64), out=np.zeros(scales.size), where=scales > 0).astype(work)
    lows = mins.astype(work)
    buf = np.empty(min(x.size, SCRATCH), work)
    for span, blocks, width in segments(x.size, block_size):
        t = buf[: span.stop - span.start].reshape(-1, width)
        np.subtract(x[span].reshape(-1, width), lows[blocks, None], out=t)
        t *= inv[blocks, None]
        if rng is None:
            t += 0.5  # now 0.5 <= t < used + 1 (< levels + 1): the scales cover each block's span
        else:
            t += rng.random(t.shape, dtype=np.float32)
            np.minimum(t, levels, out=t)  # t + U[0, 1) may reach levels + 1 in a full-width block
        q[span].reshape(-1, width)[...] = t  # float -> unsigned cast truncates: floor of a non-negative value
    return q


def dequantize(q: np.ndarray, mins: np.ndarray, scales: np.ndarray, block_size: int, out: np.ndarray) -> None:
    """Write min + q * scale per block into float32 `out` (same length as `q`, starting at a block boundary)."""
    wide = _is_wide(mins, scales, int(np.iinfo(q.dtype).max))
    for span, blocks, width in segments(q.size, block_size):
        qb, ob = q[span].reshape(-1, width), out[span].reshape(-1, width)
        if wide:
            t = qb * scales[blocks, None].astype(np.float64)
            t += mins[blocks, None]
            np.clip(t, -_F32_MAX, _F32_MAX, out=t)
            ob[...] = t
        else:
            np.multiply(qb, scales[blocks, None], out=ob)
            ob += mins[blocks, None]
