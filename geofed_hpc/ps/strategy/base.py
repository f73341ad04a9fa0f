"""The interface every aggregation strategy implements: weights, staleness, when a round closes, what it says."""

from __future__ import annotations

from abc import ABC, abstractmethod

from geofed_hpc.config import PSConfig
from geofed_hpc.errors import ProtocolError, StaleError
from geofed_hpc.ps.aggregate import Delta, Lazy, Params, dense_of, staleness_discount
from geofed_hpc.ps.rounds import OpenRound, Prepared, RoundTotals
from geofed_hpc.rpc import messages as m


class Strategy(ABC):
    """How verified deltas become global updates: what a delta must carry, how stale it may be, its weight and
    scale in the open round, when that round is ready to close, and what a heartbeat tells a site.

    Owns the open round (`round`, an OpenRound: the folding and the robust rules, mode-free). A subclass says
    only what differs: `ready` (required), `scale`, `sync_now`, and the state a snapshot keeps.

    Lock: none; not thread-safe. The coordinator's lock guards every call but `prepare`.
    """

    # A round waits for every active site (sync); else deltas come as they come, and a PS group pools them over
    # ps.peer_sync_interval.
    waits_for_sites = False

    def __init__(self, cfg: PSConfig, round: OpenRound) -> None:
        self.cfg = cfg
        self.round = round
        self._by_tokens = cfg.weighting == "tokens"

    @property
    def count(self) -> int:
        """Deltas in the open round."""
        return self.round.count

    # ---------------------------------------------------------------- admission
    def check(self, header: m.PushHeader, version: int) -> int:
        """Refuse a delta header that cannot be weighed against the global `version`; its staleness."""
        staleness = self.staleness(header.base_version, version)
        if self.cfg.outer_optimizer == "fednova" and header.local_steps < 1:
            raise ProtocolError("ps.outer_optimizer=fednova normalises by local steps: local_steps must be >= 1")
        if self._by_tokens and header.tokens < 1:
            raise ProtocolError("ps.weighting=tokens weights deltas by tokens: tokens must be >= 1")
        return staleness

    def staleness(self, base_version: int, version: int) -> int:
        """Versions between a delta's base and the global model; StaleError beyond `ps.max_staleness` or from the
        future."""
        if base_version > version:
            raise StaleError(
                f"base version {base_version} is newer than the global version {version} (a version from "
                "the future; the PS may have restarted from an older snapshot): pull the model again"
            )
        staleness = version - base_version
        if staleness > self.cfg.max_staleness:
            raise StaleError(f"delta is {staleness} versions stale (max {self.cfg.max_staleness}): pull again")
        return staleness

    def weight(self, tokens: int) -> float:
        """A delta's weight in its round's mean: its tokens with `ps.weighting=tokens`, else 1."""
        return float(tokens) if self._by_tokens else 1.0

    def scale(self, staleness: int, tokens: int) -> float:
        """The factor on a delta beside its weight: the staleness discount 1/sqrt(1+tau)."""
        return staleness_discount(staleness)

    def prepare(self, delta: Delta, session_id: str, steps: int, tokens: int) -> Prepared:
        """Clip, normalise (and for robust rules spool) a decoded delta; no lock needed."""
        return self.round.prepare(delta, session_id, steps, tokens)

    def admit(self, prepared: Prepared, base_version: int, version: int) -> int:
        """Fold a prepared delta into the open round (or discard it and raise StaleError); its staleness."""
        try:
            staleness = self.staleness(base_version, version)
        except StaleError:
            self.round.discard(prepared)
            raise
        self.round.admit(prepared, self.weight(prepared.tokens), self.scale(staleness, prepared.tokens))
        return staleness

    # ---------------------------------------------------------------- closing
    @abstractmethod
    def ready(self, active: set[str]) -> bool:
        """The open round should become a global update now (`active`: the sessions seen recently)."""

    def sync_now(self, session_id: str) -> bool:
        """A heartbeat from `session_id` should tell the site to push what it has now."""
        return False

    def take(self) -> RoundTotals:
        """Close the open round: its totals before the aggregate is taken (a new round opens; `restore` puts it
        back when its update cannot be made, `release` once it is made or refused)."""
        return self.round.take()

    def aggregate(self, totals: RoundTotals, lazy: bool = False) -> Lazy:
        """The aggregated delta of taken `totals`, in new arrays (the totals stay whole); with `lazy`, a weighted
        mean is read piece by piece when it is used."""
        return self.round.aggregate(totals, lazy)

    def restore(self, totals: RoundTotals) -> None:
        self.round.restore(totals)

    def release(self, totals: RoundTotals) -> None:
        self.round.release(totals)

    def close(self) -> tuple[Params, int]:
        """Close the open round: its aggregated delta (in new arrays) and how many deltas it holds."""
        totals = self.take()
        try:
            return {k: dense_of(v) for k, v in self.aggregate(totals).items()}, totals.count
        finally:
            self.release(totals)

    def state(self) -> dict[str, list[float]]:
        """What a snapshot keeps of the strategy, so that replaying the journal after it weighs deltas alike."""
        return {}

    def load_state(self, state: dict[str, list[float]]) -> None:  # noqa: B027 - most strategies keep nothing
        """Take what `state` kept (a snapshot of an older PS may hold nothing)."""

    def reset(self, spec: dict[str, tuple[int, ...]]) -> None:
        """Drop the open round; deltas now carry `spec` (a model was adopted)."""
        self.round.clear()
        self.round.spec = dict(spec)

    def clear(self) -> None:
        """Drop the open round (its spooled files too)."""
        self.round.clear()
