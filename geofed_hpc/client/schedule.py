"""The learning rate of a site's n-th lifetime step: linear warmup, then constant, cosine or warmup-stable-decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("constant", "cosine", "wsd")


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The lr multiplier of a site's `step`-th optimizer step (1-based) under a linear warmup of `warmup_steps`."""
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be 0 or positive, got {warmup_steps}")
    return 1.0 if warmup_steps == 0 else min(1.0, step / warmup_steps)


@dataclass(frozen=True)
class LRSchedule:
    """lr x factor(step) for a site's lifetime step count (which survives requeues, so a requeued job goes on
    where its schedule was). After `total` steps the factor stays at its last value."""

    kind: str = "constant"
    warmup: int = 0
    total: int = 0
    min_ratio: float = 0.1
    decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.kind!r}")
        if self.kind != "constant" and self.total <= self.warmup:
            raise ValueError(f"{self.kind}: total steps ({self.total}) must exceed the warmup ({self.warmup})")

    def factor(self, step: int) -> float:
        """The lr multiplier of the `step`-th optimizer step (1-based)."""
        if self.warmup and step <= self.warmup:
            return warmup_factor(step, self.warmup)
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        if self.kind == "constant":
            return 1.0
        floor = self.min_ratio
        if self.kind == "cosine":
            done = min(1.0, (step - self.warmup) / (self.total - self.warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * done))
        decay = max(1, round(self.decay_fraction * self.total))
        start = max(self.warmup, self.total - decay)  # wsd: stable until `start`, then linear down to the floor
        if step <= start:
            return 1.0
        done = min(1.0, (step - start) / (self.total - start))
        return 1.0 - (1.0 - floor) * done
