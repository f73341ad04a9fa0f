"""Aggregation math, pure: folding deltas, staleness discounts, closing rounds, applying updates."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

Params = dict[str, np.ndarray]


class MeanAccumulator:
    """Fold weighted deltas into one running sum: memory is one model's worth, whatever the count."""

    def __init__(self) -> None:
        self._sum: Params | None = None
        self.weight = 0.0
        self.count = 0

    def fold(self, delta: Mapping[str, np.ndarray], weight: float = 1.0) -> None:
        if weight <= 0:
            raise ValueError(f"weight must be positive, got {weight}")
        if self._sum is None:
            self._sum = {k: np.asarray(v, dtype=np.float32) * np.float32(weight) for k, v in delta.items()}
        else:
            if delta.keys() != self._sum.keys():
                raise ValueError("delta names differ from the ones already folded")
            for k, v in delta.items():
                self._sum[k] += np.float32(weight) * v
        self.weight += weight
        self.count += 1

    def mean(self) -> Params:
        if self._sum is None:
            raise ValueError("no delta folded yet")
        inv = np.float32(1.0 / self.weight)
        return {k: v * inv for k, v in self._sum.items()}

    def reset(self) -> None:
        self._sum, self.weight, self.count = None, 0.0, 0


def staleness_discount(staleness: int) -> float:
    """Weight of a delta computed `staleness` versions ago: 1/sqrt(1+tau) (FedAsync's polynomial rule)."""
    if staleness < 0:
        raise ValueError(f"staleness cannot be negative, got {staleness}")
    return 1.0 / math.sqrt(1.0 + staleness)


def apply_update(params: Params, update: Mapping[str, np.ndarray], lr: float) -> None:
    """Theta <- Theta + lr * update, in place; names and shapes must match."""
    for k, v in update.items():
        target = params[k]
        if target.shape != v.shape:
            raise ValueError(f"{k}: update shape {v.shape} != parameter shape {target.shape}")
        target += np.float32(lr) * v


def round_complete(pushed: set[str], active: set[str], now: float, deadline: float | None) -> bool:
    """A sync round closes when every active session pushed, or its deadline passed with at least one push."""
    if not pushed:
        return False
    if active <= pushed:
        return True
    return deadline is not None and now >= deadline
