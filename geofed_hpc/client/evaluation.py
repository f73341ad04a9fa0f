"""A site's evaluations of the global model it pulled: validation loss (and QA scores), at most as often as asked."""

from __future__ import annotations

import math
import time
from datetime import timedelta

from geofed_hpc.client.group import SiteGroup


class Evaluation:
    """The latest evaluation: `val_loss` measured at `version` (-1: none yet), `qa` (val/exact_match, val/f1 for a
    question-answering task). `due()` keeps train.eval_interval between evaluations (0s: at every sync) and, with a
    `budget` below 1 (train.eval_budget), keeps their share of the wall-clock under it: the next one comes once
    the time since the last began is at least its seconds / budget (the last sync of a run always evaluates)."""

    def __init__(self, group: SiteGroup, interval: timedelta, budget: float = 1.0) -> None:
        self.group, self.interval, self.budget = group, interval, budget
        self.val_loss = math.nan
        self.qa: dict[str, float] = {}
        self.version = -1
        self._at = -math.inf  # time.monotonic() of the last evaluation
        self.seconds = 0.0  # how long the last evaluation took

    def run(self, version: int) -> float:
        """Evaluate the model the site holds now, as the global model at `version`."""
        self._at, self.version = time.monotonic(), version
        self.val_loss = self.group.evaluate()
        self.qa = self.group.qa_metrics()
        self.seconds = time.monotonic() - self._at
        return self.val_loss

    def due(self, last: bool = False) -> bool:
        """Whether a sync evaluates now (`last`: the last sync of the run)."""
        since = time.monotonic() - self._at
        if since < self.interval.total_seconds():
            return False
        return self.budget >= 1.0 or last or since * self.budget >= self.seconds
