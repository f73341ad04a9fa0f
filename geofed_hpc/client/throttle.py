"""Deterministic slow-down of a site's step loop (train.slowdown): emulates slower hardware on this machine."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# The most steps measured before the emulated time per step is fixed (a first interval longer than this is not
# waited for).
MEASURED = 50


class Throttle:
    """Runs a step, then sleeps a fixed emulated time per step: (factor - 1) x the median compute of the site's
    first steps (until `settle`, called at the end of its first interval, before its first push leaves; at most
    MEASURED steps), measured once. While it measures, each step sleeps (factor - 1) x its own compute.

    A step is then its real compute, measured as it runs (a step that runs slower beside the sync sender's threads
    on shared cores counts as slower), plus emulated accelerator time that host contention does not multiply, as
    a real accelerator's would not be. `fixed` seconds (train.step_time) are added to every step's sleep from the
    first; factor 1 with no fixed time never sleeps."""

    def __init__(
        self,
        factor: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        fixed: float = 0.0,
    ) -> None:
        if not factor >= 1.0:
            raise ValueError(f"slow-down factor must be at least 1, got {factor}")
        if not fixed >= 0.0:
            raise ValueError(f"emulated step time must be at least 0 seconds, got {fixed}")
        self.factor, self.fixed = factor, fixed
        self.clock, self.sleep = clock, sleep
        self.measured: list[float] = []  # compute seconds of the first steps
        self.extra: float | None = None  # the fixed emulated seconds per step, once settled

    def settle(self) -> None:
        """Fix the emulated time per step from the steps measured so far (no-op once fixed or before any step)."""
        if self.extra is None and self.measured:
            self.extra = (self.factor - 1.0) * statistics.median(self.measured)

    def __call__(self, step: Callable[[], T]) -> T:
        if self.factor == 1.0:
            out = step()
            if self.fixed:
                self.sleep(self.fixed)
            return out
        t0 = self.clock()
        out = step()
        if self.extra is None:
            compute = max(0.0, self.clock() - t0)
            self.measured.append(compute)
            if len(self.measured) >= MEASURED:
                self.settle()
            self.sleep(self.fixed + (self.factor - 1.0) * compute)
        else:
            self.sleep(self.fixed + self.extra)
        return out
