"""Synchronous rounds: a round closes when every active site pushed, or at its deadline."""

from __future__ import annotations

from geofed_hpc.ps.aggregate import round_complete
from geofed_hpc.ps.strategy.base import Strategy


class SyncRounds(Strategy):
    """One global update per round of every active site's delta: the round closes when all active sessions pushed
    or `ps.round_timeout` passed with at least one delta; a site the open round still waits for hears "sync now"
    in its heartbeat. Deltas wait in the open round, so they are journaled. Lock: as Strategy."""

    def ready(self, active: set[str]) -> bool:
        return round_complete(self.round.pushed, active, self.round.now(), self.round.deadline)

    def sync_now(self, session_id: str) -> bool:
        pushed = self.round.pushed
        return bool(pushed) and session_id not in pushed
