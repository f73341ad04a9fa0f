"""How far a site got: the counters its checkpoints keep, and the training interval in progress."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Progress:
    """How far the site got (kept in its checkpoints): syncs done, tokens trained, tokens the PS applied."""

    syncs: int = 0
    tokens_seen: int = 0
    contribution_total: int = 0
    syncs_after_push: int = 0  # what `syncs` becomes once the pushed sync is counted (a stop may come first)


@dataclass
class Interval:
    """The training interval in progress: when it started, and what a requeued job carries over into it."""

    carry: tuple[int, float, float] = (0, 0.0, 0.0)  # steps, loss sum, seconds of an interrupted interval
    start: float = 0.0  # time.monotonic(), less the carried seconds

    def begin(self) -> tuple[int, float]:
        """Start an interval (continuing a carried one): the steps and loss sum it starts with."""
        steps, loss_sum, elapsed = self.carry
        self.carry = (0, 0.0, 0.0)
        self.start = time.monotonic() - elapsed
        return steps, loss_sum

    def pending(self, steps: int, loss_sum: float) -> dict[str, Any]:
        """The unpushed work a checkpoint taken now records (and a resume carries on with)."""
        return {"steps": steps, "loss_sum": loss_sum, "elapsed_s": time.monotonic() - self.start}
