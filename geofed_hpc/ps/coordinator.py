"""The PS's coordinator: composes its parts and owns the one lock every transition between versions takes."""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from geofed_hpc.config import CodecConfig, PSConfig
from geofed_hpc.errors import CheckpointError, GeofedError, ProtocolError, StaleError, UnavailableError
from geofed_hpc.faults import fault
from geofed_hpc.log import logger, quote
from geofed_hpc.paradigms.exchange import Exchange
from geofed_hpc.ps.aggregate import Delta, Params
from geofed_hpc.ps.journal import Entry
from geofed_hpc.ps.ledger import PushLedger, resent
from geofed_hpc.ps.model import GlobalModel, NonFiniteUpdate
from geofed_hpc.ps.observe import Contribution, Observer
from geofed_hpc.ps.persist import Persistence, load_init
from geofed_hpc.ps.pulls import Payload
from geofed_hpc.ps.remote import local_state, remote_state
from geofed_hpc.ps.rounds import Prepared, RoundTotals
from geofed_hpc.ps.sessions import Session, SessionTable, handle_of
from geofed_hpc.ps.staging import Staging, decode_delta
from geofed_hpc.ps.statedir import check_state_dir, require_tokens
from geofed_hpc.ps.strategy import strategy_for
from geofed_hpc.ps.tokens import TOKENS_FILE, TokenVerifier
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.guard import Caller

# What a push id may be (it comes from a site and is written into logs, snapshots and journal entries).
PUSH_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# A round whose update could not be made (a full disk) is tried again this long after.
CLOSE_RETRY = timedelta(seconds=5)


class Coordinator:
    """Composes a parameter server's parts and carries out every change of its state: the model (`model`, a
    GlobalModel), the sessions (`sessions`), the push ids (`ledger`, a PushLedger), the aggregation mode with its
    open round (`strategy`, picked once by strategy_for), the state directory (`persistence`) and what the PS shows
    (`observer`). No RPC here: ParameterServerLogic (servicer.py) turns requests into these calls.

    Lock: `_cond` (a Condition) guards model, strategy, persistence and `_closing`, none of which has a lock of its
    own; every public method holds it for its whole transition, so a push is admitted, counted, remembered, maybe
    aggregated, snapshotted and journaled as one step. The session table's, the ledger's and the observer's own
    locks nest inside it (never the other way round); what waits on the ledger (a resent push for its first stream,
    `finish` for pushes in flight) waits without it. Long-polls wait on `_versions`, a condition of their own that
    is only ever held for a counter, so the end of a call can wake them from gRPC's polling thread.
    """

    # One PS of a group (GroupedCoordinator, ps/grouped.py): its rounds close and its model moves only at the
    # group's sync points, never here alone.
    peer_sync = False

    def __init__(
        self,
        cfg: PSConfig,
        settings: m.RunSettings,
        staging: Staging,
        clock: Callable[[], float] = time.monotonic,
        exchange: Exchange | None = None,
        codec: CodecConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.settings = settings
        exchange = exchange or Exchange()  # the paradigm: what a delta carries, how an update lands on the model
        settings.paradigm = exchange.describe()
        settings.aggregation = cfg.aggregation
        self._clock = clock
        self._started = clock()
        self._retry_at = 0.0  # a round whose update could not be made is tried again from then on
        self._cond = threading.Condition()
        self._versions = threading.Condition()  # long-polls wait on it, not on `_cond`: a cancel wakes them at once
        self._published = 0  # counts the model's moves, under `_versions`
        self._closing = False
        self.group_status: Callable[[m.StatusReply], None] | None = None  # adds what the PS group shows
        state = local_state(cfg)  # ps.state_dir, or the working folder of a state on object storage
        remote = remote_state(cfg, state)
        if state is not None:  # private, or the PS does not start; a token file there: Join needs a token for good
            check_state_dir(state, "ps.state_cache" if remote else "ps.state_dir")
            if remote is not None:
                remote.pull()
            if (state / TOKENS_FILE).exists():
                require_tokens(state)
        tokens = TokenVerifier(state / TOKENS_FILE if state else None, cfg.enroll_token)
        idle_after = 3 * cfg.round_timeout.total_seconds()
        self.sessions = SessionTable(tokens, clock, idle_after, cfg.max_sessions, cfg.max_sessions_per_site)
        self.model = GlobalModel(cfg, settings, exchange, state / "updates" if state else None, codec)
        self.model.spill = lambda: staging.new_path("model")  # the encoded model of whole pulls: a file, not RAM
        self.strategy = strategy_for(cfg, staging, clock)
        self.ledger = PushLedger()
        stamp = {"aggregation": cfg.aggregation, "outer_optimizer": cfg.outer_optimizer, "paradigm": settings.paradigm}
        self.persistence = Persistence(state, stamp, remote)
        self.persistence.keep()
        self.observer = Observer()
        self._restore()
        if self.peer_sync:  # a peer that restarts: its sites may have failed over; a round waits for those back
            self.sessions.quiet()
        if cfg.init_from:
            self._init_from(Path(cfg.init_from))
        with self._cond:
            if not self.peer_sync:  # a group's peer takes the group's state at its first sync point instead
                self.persistence.replay(self._version, self.ledger.knows, self._replay_journaled, self._close_replayed)
            self._maybe_close()

    @property
    def journals(self) -> bool:
        """An admitted delta is journaled (so its staged payload must be on disk before it is handed over)."""
        return self.persistence.journals

    def _version(self) -> int | None:
        return self.model.version if self.model.initialized else None

    # ---------------------------------------------------------------- sessions, heartbeats, status
    def join(self, request: m.JoinRequest) -> m.JoinReply:
        with self._cond:
            credential, rejoin = self.sessions.join(request)
            version, initialized = self.model.version, self.model.initialized
            logger.info("site %s joined (session %s..., version %d)", request.site, handle_of(credential)[:8], version)
            return m.JoinReply(credential, rejoin, version, initialized, self.settings)

    def heartbeat(self, request: m.HeartbeatRequest) -> m.HeartbeatReply:
        with self._cond:
            session = self.sessions.get(request.session_id)
            if request.val_loss > 0 and math.isfinite(request.val_loss):
                self.observer.val_loss(session.site, request.version, request.val_loss)
                metrics = {"val/loss": request.val_loss, "sync/version": request.version}
                self.observer.site_metrics(session.site, metrics)
            if 0 < request.goodput <= 1:  # a share of wall time: anything else from the wire is dropped
                self.observer.site_metrics(session.site, {"site/goodput": request.goodput})
            if request.leaving:
                self.sessions.leave(request.session_id)
            self._maybe_close()
            sync_now = self.strategy.sync_now(session.handle)
            return m.HeartbeatReply(self.model.version, sync_now=sync_now, push=self.ledger.state(request.push_id))

    def status(self, handles: bool = True) -> m.StatusReply:
        """The federation as this PS sees it: counts, versions and site names (`handles`: each session's public
        handle too; no secret is ever in it)."""
        with self._cond:
            now = self._clock()
            reply = m.StatusReply(
                self.model.version,
                self.model.initialized,
                self.cfg.aggregation,
                self.model.size,
                now - self._started,
                self.sessions.rows(now, handles),
                self.strategy.count,
                self.cfg.outer_optimizer,
                self.cfg.robust,
                len(self.sessions.active()),
                self.persistence.snapshot_version,
                len(self.model.downlink.versions()),
                self.ledger.in_flight,
            )
            if self.group_status is not None:
                self.group_status(reply)
            return reply

    def wait_model(
        self, request: m.ModelRequest, deadline: float, caller: Caller | None = None
    ) -> tuple[m.ModelHeader, Payload]:
        """The model (or the updates since the site's version) once it reaches `request.min_version`, or at
        `deadline` (time.monotonic), shutdown, or the end of the call (`caller`: a cancelled long-poll stops waiting
        at once) with what there is. The wait holds no lock of the coordinator's."""
        with self._cond:
            self.sessions.get(request.session_id)
        if caller is not None:
            caller.on_end(self._wake_waiters)
        while True:
            with self._versions:
                seen = self._published
            with self._cond:
                session = self.sessions.get(request.session_id)  # it may have left, or its token been revoked
                self._maybe_close()
                ready = self.model.initialized and self.model.version >= request.min_version
                left = deadline - time.monotonic()
                if caller is not None and caller.ended:  # nobody to answer: nothing is made for it
                    raise UnavailableError("the call ended while it waited for a newer version")
                if ready or self._closing or left <= 0:
                    if not self.model.initialized:
                        raise StaleError("the global model is not initialized yet: push an init first")
                    header, payload = self.model.serve(request)
                    session.version = header.version
                    return header, payload
            with self._versions:
                if self._published == seen:
                    self._versions.wait(timeout=min(left, 1.0))

    def _publish(self) -> None:
        """The model moved (or the PS is stopping): wake whoever waits for it (hold `_cond`)."""
        self._cond.notify_all()
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        """Wake the long-polls (they look again); takes only `_versions`, so it may run on gRPC's polling thread."""
        with self._versions:
            self._published += 1
            self._versions.notify_all()

    # ---------------------------------------------------------------- pushes
    def begin_push(self, header: m.PushHeader) -> tuple[Session, m.PushReply | None]:
        """Check a push header before its payload is read: the pushing session, and the answer when the push was
        handled already (waiting while the same push is still in flight). Otherwise the push is in flight from
        here until `end_push`."""
        with self._cond:
            session = self.sessions.get(header.session_id)
        if not PUSH_ID.fullmatch(header.push_id):
            raise ProtocolError(
                f"push_id {quote(header.push_id, 40)} is not 1-128 letters, digits, '.', '_', ':' or '-' (every push "
                "needs one, so a retransmission is recognised)"
            )
        previous = self.ledger.claim(header.push_id, self.cfg.rpc_timeout)
        with self._cond:
            if previous is not None:
                logger.info("site %s resent push %s; not applied twice", session.site, quote(header.push_id, 12))
                return session, resent(header.push_id, previous, self.model.version)
            try:
                self._precheck(header)
            except BaseException as exc:
                session.refused += int(isinstance(exc, GeofedError))
                self.ledger.release(header.push_id)
                raise
        return session, None

    def end_push(self, session: Session, push_id: str, refused: bool) -> None:
        """The push is answered (`refused`: with an error of the site's making)."""
        with self._cond:
            session.refused += int(refused)
        self.ledger.release(push_id)

    def _precheck(self, h: m.PushHeader) -> None:
        """Refuse what the header alone shows to be wrong, before any payload byte is read."""
        if h.local_steps < 0 or h.tokens < 0:
            raise ProtocolError(f"local_steps ({h.local_steps}) and tokens ({h.tokens}) cannot be negative")
        if h.init:
            return
        if not self.model.initialized:
            raise StaleError("the global model is not initialized yet: push an init first")
        self.strategy.check(h, self.model.version)

    def seed_from(self, session: Session, header: m.PushHeader, params: Params) -> m.PushReply:
        """An init push: `params` become the global model unless there is one, or unless the site's copy is newer
        (the freshest wins: this PS came back from a snapshot older than the site's base, its journal lost)."""
        with self._cond:
            ahead = self.model.initialized and header.base_version > self.model.version
            if self.model.initialized and not ahead:
                reason = f"already initialized at version {self.model.version}: pull the global model"
                return self.ledger.remember(header.push_id, m.PushReply(False, self.model.version, reason))
            if ahead:
                assert self.model.params is not None
                ours = {k: v.shape for k, v in self.model.params.items()}
                if {k: v.shape for k, v in params.items()} != ours:
                    reason = "its tensors differ from this PS's model: pull the global model"
                    return self.ledger.remember(header.push_id, m.PushReply(False, self.model.version, reason))
                logger.warning(
                    "site %s holds version %d, newer than ours (%d; restored without the journal since): its copy "
                    "becomes the global model",
                    session.site,
                    header.base_version,
                    self.model.version,
                )
            self._seed(params, max(0, header.base_version), f"site {session.site}")
            return self.ledger.remember(header.push_id, m.PushReply(True, self.model.version))

    def admit(
        self, session: Session, header: m.PushHeader, delta: Delta, nbytes: int, staged: Path | None
    ) -> m.PushReply:
        """Fold a verified, decoded delta into the open round and answer its push. `staged`: its payload file,
        journaled first: the answer "accepted" comes only once the delta is on disk (a PS killed later replays it
        on restart), and a delta that cannot be made durable is refused (UnavailableError), nothing folded."""
        prepared = self._prepare(header, delta)
        prepared.push_id = header.push_id
        with self._cond:
            try:
                self.strategy.staleness(header.base_version, self.model.version)
                if staged is not None:
                    self.persistence.record(staged, header, session.site, self.model.version)
            except OSError as exc:
                self.strategy.round.discard(prepared)
                raise UnavailableError(
                    f"the parameter server could not make the push durable ({exc}); it was not applied: retry later"
                ) from None
            except BaseException:
                self.strategy.round.discard(prepared)
                raise
            staleness = self._fold(prepared, header, session.site, session, nbytes)
            self.observer.pushed(session.site, header, staleness, nbytes, session.tokens)
            self._maybe_close()
            reply = self.ledger.reply(header.push_id)
            if reply.accepted:  # answered with the version its round made, when it closed
                reply = self.ledger.remember(header.push_id, replace(reply, version=self.model.version))
            logger.info(
                "push from %s (base %d, staleness %d, norm %.3g, %d bytes) %s; version %d",
                session.site,
                header.base_version,
                staleness,
                prepared.norm,
                nbytes,
                "accepted" if reply.accepted else "refused",
                self.model.version,
            )
            return reply

    def _prepare(self, header: m.PushHeader, delta: Delta) -> Prepared:
        """Check and prepare (clip, normalise, spool) a delta; nothing is folded yet."""
        with self._cond:
            self.model.check(delta)  # before folding: it cannot be undone
        return self.strategy.prepare(delta, header.session_id, header.local_steps, header.tokens)

    def _fold(self, prepared: Prepared, header: m.PushHeader, site: str, session: Session | None, nbytes: int) -> int:
        """Fold a prepared delta into the open round, count it, remember its push as applied; its staleness (hold
        the lock)."""
        staleness = self.strategy.admit(prepared, header.base_version, self.model.version)
        self.observer.contributed(Contribution(site, staleness, header.tokens, nbytes))
        if session is not None:
            self.sessions.pushed(session, header, staleness, nbytes)
            self.observer.received(nbytes)
        self.ledger.remember(header.push_id, m.PushReply(True, self.model.version, "", staleness))
        return staleness

    # ---------------------------------------------------------------- versions
    def _maybe_close(self) -> None:
        if self.peer_sync:
            return
        if self.model.initialized and self.strategy.ready(self.sessions.active()) and self._clock() >= self._retry_at:
            self._close_round("ready")

    def _close_round(self, why: str, reduce: Callable[[RoundTotals], RoundTotals] | None = None) -> bool:
        """Aggregate the open round, step the outer optimizer, publish and apply the update, all or nothing (hold
        the lock). When the update cannot be made (a full disk: OSError), the round stays open, whole, and is
        tried again after CLOSE_RETRY; an update that is not finite is refused with its round (its pushes then
        read "not applied"). `reduce`: a PS group's sum of every peer's totals. Whether the model moved."""
        version = self.model.version
        # (sum, weight, count) before the mean: what a peer group reduces (a peer may hold none of the round)
        totals = self.strategy.take() if self.strategy.count else RoundTotals(0, [])
        try:
            proposal = self.model.propose(self.strategy.aggregate(reduce(totals) if reduce else totals, lazy=True))
            fault("ps.aggregate", str(version))
            self.model.commit(proposal)
        except NonFiniteUpdate as exc:
            self._refuse_round(totals, str(exc))
            return False
        except (OSError, GeofedError, ValueError) as exc:
            if totals.source is not None:
                self.strategy.restore(totals)
            self._retry_at = self._clock() + CLOSE_RETRY.total_seconds()
            logger.error(
                "the update of version %d could not be made (%s); its round of %d delta(s) stays open and is tried "
                "again in %gs",
                version,
                exc,
                totals.count,
                CLOSE_RETRY.total_seconds(),
            )
            return False
        self.strategy.release(totals)
        self._retry_at = 0.0
        self.ledger.prune(self.model.version - self.cfg.max_staleness - 1)
        self.observer.applied(self.model.version, len(self.sessions.active()), why)
        if self.model.version % self.cfg.snapshot_every == 0:
            self._snapshot()
        self._publish()
        logger.info("update from %d deltas (%s) -> version %d", totals.count, why, self.model.version)
        return True

    def _refuse_round(self, totals: RoundTotals, why: str) -> None:
        """A round whose update is refused: its deltas are dropped (journal entries too), its pushes not applied."""
        self.strategy.release(totals)
        self.observer.round_dropped()
        self.persistence.drop_round(self.model.version)
        reason = f"not applied: its round at version {self.model.version} was refused ({why})"
        for push_id in totals.push_ids:
            self.ledger.remember(push_id, m.PushReply(False, self.model.version, reason))
        logger.error("round at version %d refused, %d delta(s) dropped: %s", self.model.version, totals.count, why)

    def _close_replayed(self) -> None:
        """Replaying the journal: the round open now closed before the restart (the next entry joined the next)."""
        if self.strategy.count:
            self._close_round("replayed")

    def _adopted(self) -> None:
        """A model was adopted: no open round from before it."""
        self.strategy.reset(self.model.delta_shapes())
        self.observer.round_dropped()

    def _seed(self, params: Params, version: int, source: str) -> None:
        """Adopt `params` as a fresh global model at `version`, with no history (hold the lock)."""
        self.model.seed(params, version, source)
        self._adopted()
        self.persistence.clear_journal()
        self._snapshot()
        self._publish()

    def _snapshot(self) -> None:
        """Write the whole PS state (hold the lock); a failure is logged, never fatal: the journal still holds
        every delta since the previous snapshot. Once written, the journal's rounds before it go."""
        if not self.persistence.enabled or not self.model.initialized:
            return
        state = self.model.state()
        state.sessions, state.push_ids = self.sessions.to_json(), self.ledger.to_json()
        state.strategy = self.strategy.state()
        if self.persistence.save(state):
            self.persistence.forget_before(self.model.version)

    # ---------------------------------------------------------------- start
    def _restore(self) -> None:
        """Take the newest snapshot that loads; one that does not restore stops the PS in one line naming its file
        and field (sessions and push ids go first: nothing of the model, downlink included, is touched before)."""
        loaded = self.persistence.load()
        if loaded is None:
            return
        state, path = loaded
        field = "sessions"
        try:
            self.sessions.load_json(state.sessions)
            field = "push_ids"
            self.ledger.load_json(state.push_ids)
            field = "tensors"
            self.model.restore(state, path)
            self._adopted()
            field = "strategy"
            self.strategy.load_state(state.strategy)
        except (CheckpointError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(
                f"snapshot {path}: its {field!r} cannot be restored ({type(exc).__name__}: {exc}); the PS does not "
                f"start: restore the file from a copy, or move it out of {path.parent} (the PS then starts from the "
                "one before it, if any)"
            ) from None

    def _init_from(self, path: Path) -> None:
        if self.model.initialized:
            logger.warning(
                "ps.init_from=%s ignored: the state directory already holds version %d", path, self.model.version
            )
            return
        params, version = load_init(path)
        with self._cond:
            self._seed(params, version, f"file {path}")

    def _replay_journaled(self, entry: Entry) -> None:
        """Fold a journaled delta of the open round in again after a restart (its push remembered as applied, so a
        site's retransmission is answered as a duplicate)."""
        h = entry.header
        self.strategy.check(h, self.model.version)  # what the header alone shows (fednova needs local steps, ...)
        prepared = self._prepare(h, decode_delta(entry.payload, h, self.model.spec))
        prepared.push_id = h.push_id
        with self._cond:
            self._fold(prepared, h, entry.site, self.sessions.sessions.get(h.session_id), len(entry.payload))

    def settled(self, reply: m.PushReply, header: m.PushHeader) -> m.PushReply:
        """The answer to a push once it may be given: a single PS answers at once (its journal keeps the delta)."""
        return reply

    # ---------------------------------------------------------------- lifecycle, views
    def tick(self) -> None:
        """Close a round whose deadline passed; called periodically by the server loop."""
        with self._cond:
            self._maybe_close()
            self.persistence.keep()  # token records issued here meanwhile go to the object store too

    def begin_shutdown(self) -> None:
        """Stop long-polls from waiting (they answer with what they have); pushes in flight go on."""
        with self._cond:
            self._closing = True
            self._publish()

    def finish(self, wait: timedelta = timedelta(seconds=10)) -> None:
        """After the server stopped: wait for pushes still applying, apply the open round, snapshot."""
        self.begin_shutdown()
        self.ledger.wait_idle(wait)
        with self._cond:
            if self.model.initialized and self.strategy.count and not self.peer_sync:
                self._close_round("shutdown: applying the open round early")
            self._snapshot()
            self.strategy.clear()
        self.persistence.settle()  # the last snapshot's upload (off the lock) is in the store before the PS exits

    def ps_metrics(self) -> dict[str, float | int]:
        """The ps/* metric values now (the global validation loss once a site reported it for this version)."""
        with self._cond:
            version, active = self.model.version, len(self.sessions.active())
        return self.observer.values(version, active)

    def model_hash(self) -> str:
        """sha256 over the global model's names and bytes (tests compare it before and after bad input)."""
        with self._cond:
            return self.model.hash()

    # ---------------------------------------------------------------- for the split-learning server part (ps/split/)
    def session_site(self, session_id: str) -> str:
        """The site of a live session (AuthError when it is unknown, ended or revoked); it counts as seen."""
        with self._cond:
            return self.sessions.get(session_id).site

    def global_tensors(self, names: list[str]) -> tuple[int, Params]:
        """Copies of the named tensors of the global model, and its version (StaleError before it exists)."""
        with self._cond:
            if self.model.params is None:
                raise StaleError("the global model is not initialized yet: push an init first")
            missing = [n for n in names if n not in self.model.params]
            if missing:
                raise ProtocolError(f"the global model has no {missing[0]!r}: it is not of this paradigm's model")
            return self.model.version, {n: self.model.params[n].copy() for n in names}
