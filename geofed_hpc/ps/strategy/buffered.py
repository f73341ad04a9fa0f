"""Buffered updates: a global update after `ps.buffer_size` deltas, or at the deadline."""

from __future__ import annotations

from geofed_hpc.ps.aggregate import buffer_full
from geofed_hpc.ps.strategy.base import Strategy


class BufferedUpdates(Strategy):
    """A global update from every `ps.buffer_size` deltas (from any sites, the same one twice included), or from
    what arrived once `ps.round_timeout` passed since the first. Deltas wait in the open round, so they are
    journaled. Lock: as Strategy."""

    def ready(self, active: set[str]) -> bool:
        return buffer_full(self.round.count, self.cfg.buffer_size, self.round.now(), self.round.deadline)
