"""This PS as a member of a PS group: the sync loop that seeds, aligns, compares and closes rounds with its peers."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geofed_hpc.ckpt.atomic import PRIVATE_FILE
from geofed_hpc.config import CodecConfig, PSConfig
from geofed_hpc.errors import GeofedError
from geofed_hpc.log import logger
from geofed_hpc.ps.group.collectives import PeerLost, Traffic, allgather_bytes, broadcast_bytes
from geofed_hpc.ps.group.membership import Joined, StoreLost, connect, form, joiners, leave, reform, succeed
from geofed_hpc.ps.group.reduce import Reduced, merged, pack_state, reduce_round, unpack_state
from geofed_hpc.ps.group.sync import Decision, SyncPoint, decide
from geofed_hpc.ps.remote import local_state
from geofed_hpc.ps.rounds import RoundTotals
from geofed_hpc.rpc import messages as m

if TYPE_CHECKING:
    from geofed_hpc.ps.grouped import GroupedCoordinator

STOP_WAIT = timedelta(seconds=2)  # how long a stopping PS lets its sync point in flight finish
GROUP_LOG = "group.jsonl"  # in the state directory: one row per version the peers compared


class DigestMismatch(GeofedError):
    """The group's models differ at one version with no majority, or this PS's still differs after it took the
    majority's: it stops rather than serve it."""


@dataclass
class GroupStats:
    """What `status` shows of the group: versions whose digest every peer matched, the last digests, the last
    exchange of round sums, and the last transfer of a whole model."""

    compared: int = 0
    identical: int = 0
    digests: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    traffic: Traffic = field(default_factory=Traffic)
    adopted_from: int = -1
    generation: int = 0
    members: list[int] = field(default_factory=list)


class PeerGroup:
    """Forms the group at construction (refusing a peer that differs, naming it), then runs one thread that meets
    the peers every ps.peer_tick: each shows its SyncPoint, and all draw the same Decision from them (decide). Only
    this thread moves the model of a grouped PS (seed, adopt, close), so every peer takes the same steps in the
    same order. A failure (a peer gone, a digest mismatch) ends the loop; `failed` holds it.

    Lock: none of its own. `stats` and `failed` are written by the loop thread only (readers see whole values);
    the coordinator's lock is taken inside the coordinator's methods it calls."""

    def __init__(self, core: GroupedCoordinator, cfg: PSConfig, identity: dict[str, Any], wire: CodecConfig) -> None:
        self.core, self.cfg, self.identity = core, cfg, identity
        self.wire = replace(wire, name=cfg.peer_codec)
        self.joined: Joined = form(cfg, identity)
        self.stats = GroupStats(generation=self.joined.generation, members=list(self.joined.members))
        self.failed: GeofedError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ps-group", daemon=True)
        self._reduced: Reduced | None = None
        self._repaired_at = -1  # the version at which this PS last took the majority's model
        self._sites = 0  # sites active in the group at the last sync point
        self._expect = 0  # sites the group had before it lost a peer, until its next round closes
        core.group_status = self.fill_status

    @property
    def rank(self) -> int:
        """This PS's rank in the group's current generation."""
        return self.joined.members.index(self.cfg.peer_rank)

    def peer(self, rank: int) -> str:
        """Group rank `rank` as a log line names it: its rank in ps.peers and its address."""
        index = self.joined.members[rank]
        return f"peer {index} ({self.cfg.peers[index]})"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Leave the group (its peers re-form without this PS at their next sync point)."""
        self._stop.set()
        leave(self.cfg, self.joined)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=STOP_WAIT.total_seconds())  # a sync point in flight ends with the group
        self._shutdown()

    def _shutdown(self) -> None:
        try:
            self.joined.pg.shutdown()
        except RuntimeError as exc:  # already broken: nothing left to close
            logger.debug("PS group: closing generation %d: %s", self.joined.generation, exc)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def fill_status(self, reply: m.StatusReply) -> None:
        """What `geofed-hpc status` shows of the group: each peer as the last sync point saw it, the generation,
        the versions found identical, the last exchange of round sums."""
        members, digests = self.joined.members, self.stats.digests
        version = self.stats.versions[-1] if self.stats.versions else -1
        for index, address in enumerate(self.cfg.peers):
            rank = members.index(index) if index in members else -1
            digest = digests[rank] if 0 <= rank < len(digests) else ""
            reply.peers.append(m.PeerStatus(address, rank >= 0, version if rank >= 0 else -1, digest))
        t = self.stats.traffic
        reply.group_generation, reply.identical_versions = self.joined.generation, self.stats.identical
        reply.allreduce_s, reply.allreduce_bytes = t.seconds, t.nbytes
        reply.allreduce_ago_s = time.time() - t.at if t.at else -1.0

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.peer_tick.total_seconds()):
            try:
                self.step()
            except PeerLost as exc:  # a peer died or went silent: the others go on without it
                if self._stop.is_set():
                    return
                logger.warning("PS group: %s; re-forming without the peers that do not answer", exc)
                try:
                    self._reform([])
                except GeofedError as again:
                    self.failed = again
                    logger.error("PS group: %s", again)
                    return
            except GeofedError as exc:
                self.failed = exc
                logger.error("PS group: %s", exc)
                return

    def step(self) -> Decision:
        """One sync point with every peer (the same collectives in the same order on each)."""
        pg = self.joined.pg
        mine = self.core.sync_point()
        mine.expect = self._expect
        if self.cfg.peer_rank == self.joined.server:
            mine.joiners = joiners(self.cfg, self.joined.store, self.joined.members, self.identity)
        points = [SyncPoint.unpack(b) for b in allgather_bytes(pg, mine.pack(), "sync point")]
        self._share_tokens(points)
        decision = decide(points)
        self._sites = sum(p.active for p in points)
        if decision.action == "reform":
            self._reform(decision.peers)
        elif decision.action == "seed":
            if self.rank == decision.source:
                self.core.seed_pending()
            self._transfer(decision)
        elif decision.action == "adopt":
            self._transfer(decision)
        elif decision.action == "mismatch":
            self._mismatch(decision, points)
        elif points[0].initialized:  # every peer at the same version, the same digest: compared once
            self._compared(points)
            if decision.action == "close":
                self._close(points)
                self._expect = 0
        return decision

    def _share_tokens(self, points: list[SyncPoint]) -> None:
        """Peers whose enrollment token records differ swap them (one all-gather) and each keeps the union, so a
        token issued or revoked with `geofed-hpc token` on one PS holds on all of them (a site that fails over
        enrolls with the same token)."""
        if len({p.tokens for p in points if p.tokens}) < 2:
            return
        blobs = allgather_bytes(self.joined.pg, self.core.token_records(), "enrollment tokens")
        changed = self.core.merge_tokens(blobs, [self.peer(r) for r in range(len(blobs))])
        if changed:
            logger.info("PS group: enrollment token(s) %s taken from the peers", ", ".join(changed))

    def _reform(self, joining: list[int]) -> None:
        """A new generation: the members still alive and `joining` (ranks in ps.peers), in a new gloo group."""
        old = self.joined
        try:
            store, server, members = old.store, old.server, reform(self.cfg, old, joining)
        except StoreLost as exc:  # the server is gone: the lowest member left serves a new store
            logger.warning("PS group: %s; choosing a new server", exc)
            store, server, members = succeed(self.cfg, self.identity, old)
        if set(old.members) - set(members):  # its sites fail over to the peers left: sync rounds wait for them
            self._expect = max(self._expect, self._sites)
        self._shutdown()
        self.joined = connect(self.cfg, store, old.generation + 1, members, server)
        self.stats.generation, self.stats.members = self.joined.generation, list(members)

    def _compared(self, points: list[SyncPoint]) -> None:
        """Every peer holds the same version under the same digest: count it once."""
        version = points[0].version
        if self.stats.versions and self.stats.versions[-1] == version:
            return
        self.stats.compared += 1
        self.stats.identical += 1
        self.stats.versions.append(version)
        self.stats.digests = [p.digest for p in points]
        logger.info("PS group: version %d has digest %s on all %d peers", version, points[0].digest, len(points))
        self._record({"kind": "compared", "version": version, "digest": points[0].digest, "peers": len(points)})

    def _record(self, row: dict[str, Any]) -> None:
        """One row of <state_dir>/group.jsonl (none without a state directory): a version every peer holds under the
        same digest (compared), one that differs (mismatch), or a round the group applied (applied: its push ids)."""
        if not self.cfg.state_dir:
            return
        t = self.stats.traffic
        row.update(
            time=time.time(),
            rank=self.cfg.peer_rank,
            generation=self.joined.generation,
            allreduce_bytes=t.nbytes,
            allreduce_s=round(t.seconds, 6),
        )
        path = (local_state(self.cfg) or Path()) / GROUP_LOG
        try:
            with open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE), "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as exc:
            logger.warning("PS group: cannot write %s: %s", path, exc)

    def _transfer(self, decision: Decision, repair: bool = False) -> None:
        """The source's whole state (model, optimizer state, residual, push ids) to `decision.peers`, in one
        broadcast: peers behind adopt it; with `repair`, peers whose model differs at the same version take its
        model in place of theirs and keep their open round."""
        blob = pack_state(self.core.export_state()) if self.rank == decision.source else b""
        start = time.monotonic()
        blob = broadcast_bytes(self.joined.pg, blob, decision.source, "model transfer")
        if self.rank in decision.peers:
            state = unpack_state(blob)
            if repair:
                self.core.repair_state(state, self.peer(decision.source))
            else:
                self.core.adopt_state(state, self.peer(decision.source), quiet=decision.action == "adopt")
            self.stats.adopted_from = self.joined.members[decision.source]
            logger.info(
                "PS group: took version %d from %s (%d bytes in %.2fs)",
                state.version,
                self.peer(decision.source),
                len(blob),
                time.monotonic() - start,
            )

    def _mismatch(self, decision: Decision, points: list[SyncPoint]) -> None:
        """The same version under different digests (a model corrupted in memory or on disk). With a majority, the
        peers outside it take the model of the majority's lowest peer in one broadcast, as a returning peer does,
        and keep their open rounds; their sites find their replicas differ at their next pull and take the whole
        model. Without a majority, or when this PS still differs after taking it, this PS stops."""
        version = points[0].version
        self.stats.compared += 1
        self.stats.digests = [p.digest for p in points]
        self._record({"kind": "mismatch", "version": version, "digest": points[self.rank].digest, "peers": len(points)})
        shown = ", ".join(f"peer {self.joined.members[i]}: {p.digest}" for i, p in enumerate(points))
        mine = f"the model of this PS (peer {self.cfg.peer_rank}) at version {version}"
        if not decision.majority:
            raise DigestMismatch(f"{mine} differs from its peers' with no majority ({shown}): this PS stops serving it")
        if self.rank in decision.peers:
            if self._repaired_at == version:
                raise DigestMismatch(
                    f"{mine} still differs from the group majority after taking it from {self.peer(decision.source)} "
                    f"({shown}): this PS stops serving it"
                )
            logger.error(
                "PS group: %s differs from the group majority (%s): taking the majority's from %s",
                mine,
                shown,
                self.peer(decision.source),
            )
        else:
            differ = ", ".join(self.peer(r) for r in decision.peers)
            logger.warning("PS group: %s differ from the majority at version %d: they take its model", differ, version)
        self._transfer(decision, repair=True)
        if self.rank in decision.peers:
            self._repaired_at = version
            row = {"kind": "repaired", "version": version, "digest": self.core.sync_point().digest}
            self._record({**row, "source": self.peer(decision.source)})

    def _close(self, points: list[SyncPoint]) -> None:
        """Close the group's round: every peer's sums reduced, the same update applied on each."""
        self._reduced = None
        spec = self.core.model.delta_shapes()

        failure: list[GeofedError] = []

        def reduce(totals: RoundTotals) -> RoundTotals:
            try:
                self._reduced = reduce_round(self.joined.pg, totals, spec, self.wire, self.stats.traffic)
            except GeofedError as exc:
                failure.append(exc)
                raise
            return merged(totals, self._reduced)

        moved = self.core.close_group_round(reduce)
        if failure:
            raise failure[0]
        if self._reduced is None:
            return
        if moved:
            self.core.learn_pushes(self._reduced.push_ids)
            row = {"kind": "applied", "version": self.core.sync_point().version, "count": self._reduced.total.count}
            self._record({**row, "peers": len(points), "push_ids": self._reduced.push_ids})
        logger.info(
            "PS group: round of %d delta(s) from %d peers reduced (%s, %d bytes in %.3fs)",
            self._reduced.total.count,
            len(points),
            self.wire.name,
            self.stats.traffic.nbytes,
            self.stats.traffic.seconds,
        )
