"""Exactly-once pushes: the replies of pushes already handled and the ids of pushes in flight."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from geofed_hpc.rpc import messages as m

MAX_REMEMBERED_PUSHES = 10_000
PERSISTED_PUSH_IDS = 2_000


class PushLedger:
    """Owns what the PS knows of push ids: the reply of each push it handled (the newest MAX_REMEMBERED_PUSHES in
    memory, the newest PERSISTED_PUSH_IDS in snapshots) and the ids being received or applied now. A resent push
    is answered from here, never applied twice; a site asking about an unanswered push learns what became of it.

    Lock: none; not thread-safe. The coordinator's lock guards every call (its condition is what a resent push
    waits on while the same id is still in flight), so a push is remembered in the same critical section that
    admits it and a snapshot taken there sees it.
    """

    def __init__(self) -> None:
        self._replies: OrderedDict[str, m.PushReply] = OrderedDict()
        self._inflight: set[str] = set()

    def start(self, push_id: str) -> None:
        """A push's stream is being received (and then applied)."""
        self._inflight.add(push_id)

    def finish(self, push_id: str) -> None:
        """The push is answered, applied or refused."""
        self._inflight.discard(push_id)

    def receiving(self, push_id: str) -> bool:
        return push_id in self._inflight

    @property
    def in_flight(self) -> int:
        """How many pushes are being received or applied now."""
        return len(self._inflight)

    def knows(self, push_id: str) -> bool:
        """A reply for `push_id` is remembered (accepted or not)."""
        return push_id in self._replies

    def remember(self, push_id: str, reply: m.PushReply) -> m.PushReply:
        """Keep `reply` as the answer to `push_id` (the oldest beyond the limit is forgotten); return it."""
        self._replies[push_id] = reply
        while len(self._replies) > MAX_REMEMBERED_PUSHES:
            self._replies.popitem(last=False)
        return reply

    def duplicate(self, push_id: str, version: int) -> m.PushReply | None:
        """The answer to a resent push already handled (None: not handled), at global `version` now."""
        previous = self._replies.get(push_id)
        if previous is None:
            return None
        reason = previous.reason or f"duplicate of push {push_id[:8]}, applied once at version {previous.version}"
        return m.PushReply(previous.accepted, version, reason, previous.staleness, True)

    def state(self, push_id: str) -> str:
        """What a site asking about its unanswered push learns: "applied", "receiving" (a stream of it is still
        arriving), or "" (not held: never got, refused, or a stream that broke off)."""
        if not push_id:
            return ""
        if push_id in self._inflight:
            return "receiving"
        previous = self._replies.get(push_id)
        return "applied" if previous is not None and previous.accepted else ""

    def to_json(self) -> list[list[Any]]:
        """The newest PERSISTED_PUSH_IDS replies as [push id, accepted, version, reason, staleness] rows."""
        rows = [[k, r.accepted, r.version, r.reason, r.staleness] for k, r in self._replies.items()]
        return rows[-PERSISTED_PUSH_IDS:]

    def load_json(self, rows: list[list[Any]]) -> None:
        """Remember the replies of a snapshot's rows (see to_json)."""
        for push_id, accepted, version, reason, staleness in rows:
            self.remember(push_id, m.PushReply(accepted, version, reason, staleness))
