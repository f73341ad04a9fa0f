"""A parameter server in a PS group: the coordinator whose rounds and model move only at the group's sync points."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from geofed_hpc.errors import CheckpointError, UnavailableError
from geofed_hpc.log import logger
from geofed_hpc.ps.aggregate import Params
from geofed_hpc.ps.coordinator import Coordinator
from geofed_hpc.ps.group.sync import SyncPoint
from geofed_hpc.ps.persist import PSState
from geofed_hpc.ps.rounds import RoundTotals
from geofed_hpc.ps.sessions import Session
from geofed_hpc.ps.tokens import TokenFile, canonical, from_canonical
from geofed_hpc.rpc import messages as m


class GroupedCoordinator(Coordinator):
    """A Coordinator of one PS in a group (ps.peers). Its sync loop (ps/group/member.py, the only caller of the
    methods below) seeds the model, closes rounds on the group's summed totals and hands whole states between
    peers; a round never closes here alone, and an init push waits for the group to pick one."""

    peer_sync = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._seeds: list[tuple[m.PushHeader, Params, str]] = []  # init pushes the group has yet to pick from
        super().__init__(*args, **kwargs)
        path = self.sessions.verifier.path  # the token file (None without a state directory)
        self.token_file = TokenFile(path) if path is not None else None
        self._token_trouble = ""  # the last problem merging the peers' tokens, logged once
        self._pooled_since = self._clock()  # async / buffered: when the group last applied its pooled deltas

    def seed_from(self, session: Session, header: m.PushHeader, params: Params) -> m.PushReply:
        with self._cond:
            return self._seed_in_group(session, header, params)

    def _seed_in_group(self, session: Session, header: m.PushHeader, params: Params) -> m.PushReply:
        """An init push to a grouped PS waits for the group's next sync point, which seeds the group from one
        peer's first offer; accepted when it was this push (hold the lock)."""
        if not self.model.initialized:
            self._seeds.append((header, params, session.site))
            deadline = time.monotonic() + self.cfg.peer_timeout.total_seconds()
            while not self.model.initialized and not self._closing and time.monotonic() < deadline:
                self._cond.wait(timeout=0.5)
        if self.ledger.knows(header.push_id):
            return self.ledger.reply(header.push_id)
        if not self.model.initialized:
            raise UnavailableError("the PS group has not seeded its model yet: retry")
        reason = f"the PS group's model is at version {self.model.version}: pull the global model"
        return self.ledger.remember(header.push_id, m.PushReply(False, self.model.version, reason))

    def sync_point(self) -> SyncPoint:
        """What this PS shows its peers at a sync point. Sync rounds: whether every active site pushed and whether
        the round's deadline passed. Async and buffered: never complete; due once ps.peer_sync_interval passed
        since the group last applied its pooled deltas. And the digest of its enrollment token records."""
        with self._cond:
            active, r = self.sessions.active(), self.strategy.round
            if self.strategy.waits_for_sites:
                complete, timed_out = active <= r.pushed, r.deadline is not None and r.now() >= r.deadline
            else:
                interval = self.cfg.peer_sync_interval.total_seconds()
                complete, timed_out = False, self._clock() - self._pooled_since >= interval
            digest = self.model.digest().hex() if self.model.initialized else ""
            init, version = self.model.initialized, self.model.version
            point = SyncPoint(init, version, digest, r.count, complete, timed_out, bool(self._seeds))
            point.active = len(active)
            point.min_sites = self.cfg.min_sites if self.strategy.waits_for_sites else 0
        records = self.token_records()
        point.tokens = hashlib.sha256(records).hexdigest() if records else ""
        return point

    # ---------------------------------------------------------------- enrollment tokens, shared by the group
    def token_records(self) -> bytes:
        """This PS's token records as its peers take them (b"": it shares none, having no state directory, or
        while its token file cannot be read)."""
        with self._cond:  # the verifier is the sessions', used under this lock
            records = self.sessions.verifier.records()
        return canonical(records) if records is not None else b""

    def merge_tokens(self, blobs: list[bytes], sources: list[str]) -> list[str]:
        """Every peer's token records (token_records, in `sources`' order) merged into this PS's token file: a
        token issued on any peer admits its site on every peer, one revoked on any is revoked on all. The ids
        that changed here (none when the file cannot be read or written: that is logged, the group goes on)."""
        if self.token_file is None:
            return []
        try:
            records = [r for blob, src in zip(blobs, sources, strict=True) if blob for r in from_canonical(blob, src)]
            return self.token_file.merge(records)
        except (CheckpointError, OSError) as exc:
            if str(exc) != self._token_trouble:  # each problem is logged once, not at every sync point
                self._token_trouble = str(exc)
                logger.warning("PS group: the peers' enrollment tokens cannot be merged here: %s", exc)
            return []

    def seed_pending(self) -> None:
        """The group seeds from this PS: the first init push offered here becomes the model."""
        with self._cond:
            header, params, site = self._seeds[0]
            self._seeds.clear()
            self._seed(params, max(0, header.base_version), f"site {site}")
            self.ledger.remember(header.push_id, m.PushReply(True, self.model.version))

    def export_state(self) -> PSState:
        """The model, optimizer state, downlink residual, push ids and strategy state a peer adopts (not copied:
        in a group only its sync loop moves the model)."""
        with self._cond:
            state = self.model.state()
            state.push_ids, state.strategy = self.ledger.to_json(), self.strategy.state()
            return state

    def adopt_state(self, state: PSState, source: str, quiet: bool = True) -> None:
        """Take a peer's whole state in place of this PS's: its open round and journal go (their sites' pushes
        are the peer group's to apply now), its push ids join the ones known here. With `quiet` (a PS that was
        away or behind) its sessions count as idle until their sites are back; the group's first model (seed)
        keeps them active: those sites joined here and wait for it."""
        with self._cond:
            self.model.seed(state.params, state.version, source)
            self.model.outer.load_state(state.momentum)
            self.model.downlink.residual = state.residual
            self._adopted()
            self.strategy.load_state(state.strategy)
            self.ledger.load_json(state.push_ids)
            self._seeds.clear()
            if quiet:  # its sites may have failed over to a peer: they count once they are back
                self.sessions.quiet()
            self.persistence.clear_journal()
            self._snapshot()
            self._publish()

    def repair_state(self, state: PSState, source: str) -> None:
        """Take a peer's model of this version in place of this PS's, which differs from the group majority's:
        model, optimizer state and downlink residual (with no kept updates: sites take the whole model next). The
        open round and its journal stay (their deltas are this PS's sites' to add); push ids join."""
        with self._cond:
            if state.version != self.model.version:
                raise UnavailableError(f"{source} sent version {state.version} to repair version {self.model.version}")
            self.model.seed(state.params, state.version, source)
            self.model.outer.load_state(state.momentum)
            self.model.downlink.residual = state.residual
            self.ledger.load_json(state.push_ids)
            self._snapshot()
            self._publish()

    def settled(self, reply: m.PushReply, header: m.PushHeader) -> m.PushReply:
        """A grouped PS answers a delta once the group applied its round (every peer knows its push id then), so
        a site whose PS dies before that pushes it again to the next PS, where it is applied once; a single PS
        answers at once (its journal keeps the delta)."""
        if header.init or not reply.accepted or reply.duplicate:
            return reply
        deadline = time.monotonic() + 0.9 * self.cfg.rpc_timeout.total_seconds()
        with self._cond:

            def waiting() -> bool:  # its round not yet applied, nor refused (an update that was not finite)
                return self.model.version <= reply.version and self.ledger.reply(header.push_id).accepted

            while waiting() and not self._closing and time.monotonic() < deadline:
                self._cond.wait(timeout=1.0)
            if self.model.version <= reply.version and self._closing:
                raise UnavailableError("this parameter server stopped before the group applied the push: push again")
            return replace(self.ledger.reply(header.push_id), version=self.model.version)

    def close_group_round(self, reduce: Callable[[RoundTotals], RoundTotals]) -> bool:
        """Close the group's round with every peer's sums (`reduce`); whether the model moved."""
        with self._cond:
            moved = self._close_round("group", reduce)
            if moved:
                self._pooled_since = self._clock()
            return moved

    def learn_pushes(self, push_ids: list[str]) -> None:
        """Pushes a peer applied in the round just closed: a resend of one here is answered, never applied."""
        with self._cond:
            for push_id in push_ids:
                if not self.ledger.knows(push_id):
                    self.ledger.remember(push_id, m.PushReply(True, self.model.version))
