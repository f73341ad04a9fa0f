"""Jittered exponential backoff under a wall-clock budget (how long a call may keep retrying, not how often)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from datetime import timedelta

FIRST_WAIT = timedelta(milliseconds=500)
MAX_WAIT = timedelta(seconds=8)


class Backoff:
    """Waits of FIRST_WAIT, then twice as long each time up to MAX_WAIT, each drawn uniformly from its upper
    half (so sites cut off together do not all come back in the same instant); `next_wait` is None once the
    budget is spent. A budget of 0 allows no retry at all."""

    def __init__(
        self,
        budget: timedelta,
        first: timedelta = FIRST_WAIT,
        cap: timedelta = MAX_WAIT,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.budget = budget
        self._clock = clock
        self._deadline = clock() + budget.total_seconds()
        self._wait = self._first = first.total_seconds()
        self._cap = cap.total_seconds()
        self._rng = rng or random.Random()
        self.attempts = 0

    @property
    def elapsed(self) -> float:
        return self._clock() - (self._deadline - self.budget.total_seconds())

    def restart(self) -> None:
        """The next waits start from FIRST_WAIT again, within the same budget (a call that moved to another PS)."""
        self._wait = self._first

    def next_wait(self) -> float | None:
        """Seconds to sleep before the next attempt (never past the budget), or None when none is left."""
        self.attempts += 1
        left = self._deadline - self._clock()
        if left <= 0:
            return None
        wait = min(self._rng.uniform(self._wait / 2, self._wait), left)
        self._wait = min(self._wait * 2, self._cap)
        return wait
