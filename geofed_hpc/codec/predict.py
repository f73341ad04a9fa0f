"""Row prediction of quantized symbols: per block, code each symbol minus the one a row above when that is narrower."""

# A matrix delta often moves whole rows alike (embedding rows of tokens a batch never saw all get the same
# push from the softmax), so symbol[i] - symbol[i - row] (modulo the symbol range) is then far narrower than
# symbol[i] itself. The choice is made per block from a sample; mode 1 = predicted, 0 = plain.

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

SAMPLE = 4096  # symbols per block the choice looks at (or four rows, if more)
LOOP_ROWS = 2048  # undo row by row (fast) up to this many rows per block, with cumsum beyond


def usable(row: int, block_size: int) -> bool:
    """Whether blocks of `block_size` hold at least two rows of `row` symbols."""
    return row > 0 and block_size >= 2 * row


def _runs(q: np.ndarray, modes: np.ndarray, block_size: int) -> Iterator[np.ndarray]:
    """2-D views (blocks x width) of each run of consecutive predicted blocks; the short tail block alone."""
    full = q.size // block_size
    picked = np.flatnonzero(modes[:full])
    if picked.size:
        breaks = np.flatnonzero(np.diff(picked) > 1) + 1
        for run in np.split(picked, breaks):
            yield q[run[0] * block_size : (run[-1] + 1) * block_size].reshape(-1, block_size)
    if full < modes.size and modes[full]:
        yield q[full * block_size :].reshape(1, -1)


def choose(q: np.ndarray, block_size: int, row: int) -> np.ndarray:
    """Mode per block (uint8): 1 where the sampled spread of row differences is below the plain spread."""
    modes = np.zeros(-(-q.size // block_size), np.uint8)
    if not usable(row, block_size):
        return modes
    full = q.size // block_size
    parts = [(q[: full * block_size].reshape(-1, block_size), 0)] if full else []
    if full < modes.size and q.size - full * block_size >= 2 * row:
        parts.append((q[full * block_size :].reshape(1, -1), full))
    for qb, first in parts:
        s = qb[:, : max(SAMPLE, 4 * row)].astype(np.int32)
        plain = np.abs(s - s.mean(axis=1, keepdims=True, dtype=np.float32)).sum(axis=1) / s.shape[1]
        diff = np.abs(s[:, row:] - s[:, :-row]).sum(axis=1) / (s.shape[1] - row)
        modes[first : first + qb.shape[0]] = diff < plain
    return modes


def apply(q: np.ndarray, modes: np.ndarray, block_size: int, row: int, mask: int) -> None:
    """In place: in predicted blocks, symbol[i] -= symbol[i - row] (block-local, modulo mask + 1)."""
    for view in _runs(q, modes, block_size):
        if view.shape[1] <= row:
            continue
        view[:, row:] -= view[:, :-row].copy()
        if mask != np.iinfo(q.dtype).max:
            view &= mask


def undo(q: np.ndarray, modes: np.ndarray, block_size: int, row: int, mask: int) -> None:
    """In place: the inverse of `apply` (a running sum down each column of every predicted block)."""
    for view in _runs(q, modes, block_size):
        width = view.shape[1]
        if width <= row:
            continue
        whole = width // row * row
        head = view[:, :whole].reshape(view.shape[0], -1, row)
        if head.shape[1] <= LOOP_ROWS:  # a loop over rows runs ~6x faster than cumsum along the middle axis
            for r in range(1, head.shape[1]):
                head[:, r] += head[:, r - 1]
        else:
            np.cumsum(head, axis=1, dtype=q.dtype, out=head)
        if whole < width:
            view[:, whole:] += head[:, -1, : width - whole]
        if mask != np.iinfo(q.dtype).max:
            view &= mask
