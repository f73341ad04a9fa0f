"""A model's identity on the wire: one xxh3-128 digest over its tensors' names, dtypes, shapes and bytes."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import xxhash


def model_digest(params: Mapping[str, np.ndarray]) -> bytes:
    """16 bytes that differ when any tensor of `params` differs in a bit (names taken in sorted order). Versions
    count updates; this tells two models of the same version apart (a PS that restarted or was re-seeded)."""
    h = xxhash.xxh3_128()
    for name in sorted(params):
        value = np.ascontiguousarray(params[name])
        h.update(f"{name}\0{value.dtype.str}\0{value.shape}\0".encode())
        h.update(value.reshape(-1).view(np.uint8).data if value.size else b"")
    return h.digest()
