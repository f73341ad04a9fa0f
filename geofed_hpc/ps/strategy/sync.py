"""Synchronous rounds: a round closes when every active site pushed, or at its deadline."""

from __future__ import annotations

from geofed_hpc.ps.aggregate import round_complete
from geofed_hpc.ps.strategy.base import Strategy


class SyncRounds(Strategy):
    """One global update per round of every active site's delta: the round closes when all active sessions (and at
    least `ps.min_sites`) pushed or `ps.round_timeout` passed with at least one delta; a site the open round still
    waits for hears "sync now" in its heartbeat. Deltas wait in the open round, so they are journaled.
    Lock: as Strategy."""

    waits_for_sites = True

    def ready(self, active: set[str]) -> bool:
        r = self.round
        if len(r.pushed) < self.cfg.min_sites:  # too few sites for a round yet: only its deadline closes it
            return r.deadline is not None and r.now() >= r.deadline
        return round_complete(r.pushed, active, r.now(), r.deadline)

    def sync_now(self, session_id: str) -> bool:
        pushed = self.round.pushed
        return bool(pushed) and session_id not in pushed
