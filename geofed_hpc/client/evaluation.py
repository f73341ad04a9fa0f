"""A site's evaluations of the global model it pulled: validation loss (and QA scores), at most as often as asked."""

from __future__ import annotations

import math
import time
from datetime import timedelta

from geofed_hpc.client.group import SiteGroup


class Evaluation:
    """The latest evaluation: `val_loss` measured at `version` (-1: none yet), `qa` (val/exact_match, val/f1 for a
    question-answering task). `due()` keeps train.eval_interval between evaluations (0s: at every sync)."""

    def __init__(self, group: SiteGroup, interval: timedelta) -> None:
        self.group, self.interval = group, interval
        self.val_loss = math.nan
        self.qa: dict[str, float] = {}
        self.version = -1
        self._at = -math.inf  # time.monotonic() of the last evaluation

    def run(self, version: int) -> float:
        """Evaluate the model the site holds now, as the global model at `version`."""
        self._at, self.version = time.monotonic(), version
        self.val_loss = self.group.evaluate()
        self.qa = self.group.qa_metrics()
        return self.val_loss

    def due(self) -> bool:
        return time.monotonic() - self._at >= self.interval.total_seconds()
