"""Error feedback: the part of each delta the codec lost stays on the site and rides on the next delta."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from geofed_hpc.codec.stream import encode
from geofed_hpc.config import CodecConfig
from geofed_hpc.log import logger

PREFIX = "residual/"  # checkpoint tensor names: residual/<param>


class ErrorFeedback:
    """Holds the residual (true delta - decoded delta) per tensor; `encode` adds it, `commit` replaces it."""

    def __init__(self) -> None:
        self.residual: dict[str, np.ndarray] = {}

    def encode(self, delta: Mapping[str, np.ndarray], cfg: CodecConfig) -> tuple[bytes, dict[str, np.ndarray]]:
        """Payload of delta + residual (added into `delta`'s float32 arrays in place) and the new residual.

        Call `commit` with the new residual once the PS has the payload; a push that is dropped keeps the old.
        """
        for name, r in self.residual.items():
            d = delta.get(name)
            if d is None or d.shape != r.shape or d.dtype != np.float32:
                logger.warning("error feedback: dropping the residual of %r (no float32 delta of its shape)", name)
                continue
            d += r
        new: dict[str, np.ndarray] = {}
        payload = encode(delta, cfg, residual=new)
        return payload, {k: v for k, v in new.items() if v.any()}

    def commit(self, residual: dict[str, np.ndarray]) -> None:
        self.residual = residual

    def keep(self, delta: Mapping[str, np.ndarray]) -> None:
        """Push nothing now: `delta` plus the residual becomes the residual (it rides on the next delta)."""
        kept = {k: np.array(v, np.float32) for k, v in delta.items()}
        for name, r in self.residual.items():
            if name in kept and kept[name].shape == r.shape:
                kept[name] += r
        self.residual = {k: v for k, v in kept.items() if v.any()}

    def state(self) -> dict[str, np.ndarray]:
        """Checkpoint tensors: residual/<name>."""
        return {PREFIX + k: v for k, v in self.residual.items()}

    def load(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Restore from checkpoint tensors (the residual/<name> ones; others are ignored)."""
        self.residual = {
            k[len(PREFIX) :]: np.asarray(v, np.float32) for k, v in tensors.items() if k.startswith(PREFIX)
        }
