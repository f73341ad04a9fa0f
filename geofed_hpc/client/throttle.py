"""Deterministic slow-down of a site's step loop (train.slowdown): emulates slower hardware on this machine."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Throttle:
    """Runs a step, then sleeps (factor - 1) times the step's measured compute time: the loop goes `factor` times
    slower than this machine does at that moment, so speed ratios between sites hold under any load.
    factor 1 never sleeps."""

    def __init__(
        self,
        factor: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not factor >= 1.0:
            raise ValueError(f"slow-down factor must be at least 1, got {factor}")
        self.factor = factor
        self.clock, self.sleep = clock, sleep

    def __call__(self, step: Callable[[], T]) -> T:
        if self.factor == 1.0:
            return step()
        t0 = self.clock()
        out = step()
        self.sleep((self.factor - 1.0) * max(0.0, self.clock() - t0))
        return out
