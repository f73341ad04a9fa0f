"""Exactly-once pushes: the replies of pushes already handled and the ids of pushes in flight."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from datetime import timedelta
from typing import Any

from geofed_hpc.errors import UnavailableError
from geofed_hpc.rpc import messages as m

# At least this many replies are remembered; beyond it, only those a resend could still be applied against.
MAX_REMEMBERED_PUSHES = 10_000


class PushLedger:
    """Owns what the PS knows of push ids: the reply of each push it handled and the ids being received or applied
    now. A resent push is answered from here, never applied twice; a site asking about an unanswered push learns
    what became of it. Every reply remembered is in the snapshots too.

    How long a reply is remembered: while a resend of its push could still be applied, i.e. while its version is
    within `ps.max_staleness` of the global version (`prune` sets that floor at each new version; an older resend is
    refused as stale, so it is never applied twice either), and in any case the newest MAX_REMEMBERED_PUSHES.

    Lock: its own condition `_cond` guards both. It calls nothing while holding it, so the coordinator may call in
    with its lock held (it remembers a push in the same step that admits it, so a snapshot there sees it) except
    for the two methods that wait, `claim` and `wait_idle`: a push in flight needs the coordinator's lock to end.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._replies: OrderedDict[str, m.PushReply] = OrderedDict()
        self._inflight: set[str] = set()
        self._floor = 0  # replies of pushes applied before this version may be forgotten

    def claim(self, push_id: str, timeout: timedelta) -> m.PushReply | None:
        """Take `push_id` in flight (None), or the reply remembered when it was handled already. While another
        stream of it is in flight, wait up to `timeout` for it to end (then UnavailableError). Call without the
        coordinator's lock."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while push_id in self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise UnavailableError(f"push {push_id[:8]} is still being received on another stream; retry")
                self._cond.wait(min(left, 0.5))
            previous = self._replies.get(push_id)
            if previous is None:
                self._inflight.add(push_id)
            return previous

    def release(self, push_id: str) -> None:
        """The claimed push is answered, applied or refused."""
        with self._cond:
            self._inflight.discard(push_id)
            self._cond.notify_all()

    def wait_idle(self, timeout: timedelta) -> bool:
        """Wait up to `timeout` until no push is in flight; whether none is. Call without the coordinator's lock."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._inflight, timeout.total_seconds())

    @property
    def in_flight(self) -> int:
        """How many pushes are being received or applied now."""
        with self._cond:
            return len(self._inflight)

    def knows(self, push_id: str) -> bool:
        """A reply for `push_id` is remembered (accepted or not)."""
        with self._cond:
            return push_id in self._replies

    def remember(self, push_id: str, reply: m.PushReply) -> m.PushReply:
        """Keep `reply` as the answer to `push_id`; return it."""
        with self._cond:
            self._replies[push_id] = reply
            self._evict()
        return reply

    def reply(self, push_id: str) -> m.PushReply:
        """The reply remembered for `push_id` (KeyError when there is none)."""
        with self._cond:
            return self._replies[push_id]

    def prune(self, floor: int) -> None:
        """The global version moved: replies of pushes applied before `floor` may go (beyond the newest
        MAX_REMEMBERED_PUSHES), since a resend of them is refused as stale."""
        with self._cond:
            self._floor = max(self._floor, floor)
            self._evict()

    def _evict(self) -> None:
        while len(self._replies) > MAX_REMEMBERED_PUSHES:
            oldest = next(iter(self._replies.values()))
            if oldest.version >= self._floor:
                return
            self._replies.popitem(last=False)

    def state(self, push_id: str) -> str:
        """What a site asking about its unanswered push learns: "applied", "receiving" (a stream of it is still
        arriving), or "" (not held: never got, refused, or a stream that broke off)."""
        if not push_id:
            return ""
        with self._cond:
            if push_id in self._inflight:
                return "receiving"
            previous = self._replies.get(push_id)
        return "applied" if previous is not None and previous.accepted else ""

    def to_json(self) -> list[list[Any]]:
        """Every remembered reply as a [push id, accepted, version, reason, staleness] row, oldest first."""
        with self._cond:
            return [[k, r.accepted, r.version, r.reason, r.staleness] for k, r in self._replies.items()]

    def load_json(self, rows: list[list[Any]]) -> None:
        """Remember the replies of a snapshot's rows (see to_json)."""
        for push_id, accepted, version, reason, staleness in rows:
            self.remember(push_id, m.PushReply(accepted, version, reason, staleness))


def resent(push_id: str, previous: m.PushReply, version: int) -> m.PushReply:
    """The answer to a push resent after it was handled (`previous`), at global `version` now: never applied twice."""
    reason = previous.reason or f"duplicate of push {push_id[:8]}, applied once at version {previous.version}"
    return m.PushReply(previous.accepted, version, reason, previous.staleness, True)
