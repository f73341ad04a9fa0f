"""Slots that one family of sites can never hold all of: pushes read at once, downloads sent at once, decoders."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

from geofed_hpc.errors import LimitError, UnavailableError

# A caller waiting for a slot looks this often whether its call ended meanwhile.
POLL = timedelta(milliseconds=200)
# How long a caller told "busy" or "too many" is asked to wait before it tries again.
RETRY_AFTER = timedelta(seconds=2)


class FairSlots:
    """`size` slots; while the federation has sites of several families (`contended`), one family (a site and its
    numbered jobs, `tokens.family_of`) holds at most `share` of them at once, all but a quarter of them by default
    (at least one kept: of 4 slots a family takes 3, of 16 it takes 12, of 2 it takes 1), so that whatever one family
    does (pushes that stall, downloads nobody reads), the others find the rest; a federation of one family uses them
    all. A waiting caller gives up at its deadline, or as soon as its call ended.

    Lock: `_cond` guards the counts; nothing waits while holding it but the condition's own wait (`contended` is
    asked under it, and must not wait on anything that waits for a slot)."""

    def __init__(self, size: int, share: int | None = None, contended: Callable[[], bool] = lambda: True) -> None:
        self.size = size
        self.share = share if share is not None else max(1, size - max(1, size // 4))
        self.contended = contended
        self._cond = threading.Condition()
        self._held: Counter[str] = Counter()
        self._total = 0

    def _free_for(self, family: str) -> bool:
        return self._total < self.size and (self._held[family] < self.share or not self.contended())

    def try_take(self, family: str) -> bool:
        """Take a slot for `family` if one is free for it now."""
        with self._cond:
            if not self._free_for(family):
                return False
            self._held[family] += 1
            self._total += 1
            return True

    def give_back(self, family: str) -> None:
        with self._cond:
            self._held[family] -= 1
            if self._held[family] <= 0:
                del self._held[family]
            self._total -= 1
            self._cond.notify_all()

    @contextmanager
    def held(
        self, family: str, timeout: timedelta, what: str, ended: Callable[[], bool] = lambda: False
    ) -> Iterator[None]:
        """Hold a slot for `family`, waiting up to `timeout` (then LimitError naming `what`, with a retry hint), or
        until `ended()` says the call is over (UnavailableError)."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while not self._free_for(family):
                if ended():
                    raise UnavailableError(f"the call ended while it waited for one of the PS's {what} slots")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LimitError(f"the parameter server is busy with other {what}; retry", RETRY_AFTER)
                self._cond.wait(min(left, POLL.total_seconds()))
            self._held[family] += 1
            self._total += 1
        try:
            yield
        finally:
            self.give_back(family)

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._total
