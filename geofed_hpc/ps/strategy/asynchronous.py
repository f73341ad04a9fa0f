"""Asynchronous updates: every delta becomes a global update on arrival, discounted by its staleness."""

from __future__ import annotations

from geofed_hpc.config import PSConfig
from geofed_hpc.ps.aggregate import RelativeWork, staleness_discount
from geofed_hpc.ps.rounds import OpenRound
from geofed_hpc.ps.strategy.base import Strategy


class AsyncUpdates(Strategy):
    """Each admitted delta closes its round at once (a round of one), scaled by 1/sqrt(1+staleness); with
    `ps.weighting=tokens` also by its tokens over the mean of recent deltas' (RelativeWork: a mean of one delta
    would cancel its own weight). Owns the RelativeWork window, kept in snapshots so that a journal replayed after
    one weighs its deltas as they were weighed. Lock: as Strategy."""

    def __init__(self, cfg: PSConfig, round: OpenRound) -> None:
        super().__init__(cfg, round)
        self._work = RelativeWork()

    def scale(self, staleness: int, tokens: int) -> float:
        discount = staleness_discount(staleness)
        if self._by_tokens:
            discount *= self._work.weight(tokens)
        return discount

    def ready(self, active: set[str]) -> bool:
        return self.round.count > 0

    def state(self) -> dict[str, list[float]]:
        return {"recent_tokens": self._work.recent()}

    def load_state(self, state: dict[str, list[float]]) -> None:
        self._work.load(state.get("recent_tokens", []))
