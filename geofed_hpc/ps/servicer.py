"""The parameter server's RPCs behind geofed.v1: joins, heartbeats, status, model downloads and pushes."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from geofed_hpc import codec
from geofed_hpc.errors import (
    CodecError,
    GeofedError,
    MismatchError,
    ProtocolError,
    StaleError,
    UnavailableError,
)
from geofed_hpc.faults import fault
from geofed_hpc.log import logger
from geofed_hpc.ps.aggregate import Params, staleness_discount
from geofed_hpc.ps.journal import sync_file
from geofed_hpc.ps.rounds import Prepared
from geofed_hpc.ps.sessions import Session
from geofed_hpc.ps.state import Contribution, GlobalState
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import first_header, to_chunks

MAX_REMEMBERED_PUSHES = 10_000


class ParameterServerLogic(GlobalState):
    """Runs in memory (tests call it directly) and behind rpc.server (real gRPC); never opens sockets.

    A push is received into a staging file and verified (length, sha256) before anything is decoded; a pool of
    `ps.decode_threads` threads decodes verified pushes and folds them into the open round. At most
    `ps.max_concurrent_pushes` streams are read and `ps.max_concurrent_downloads` sent at once; the others wait.
    With a state directory, a delta admitted to a round that stays open is journaled before it is answered.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._replay_journal()

    # ---------------------------------------------------------------- RPCs
    def join(self, request: m.JoinRequest) -> m.JoinReply:
        theirs, ours = request.paradigm or "identity", self.settings.paradigm
        if theirs != ours:
            raise MismatchError(
                f"site {request.site} is configured with paradigm {theirs}, this parameter server with {ours}: "
                "give the site the PS's paradigm settings (or restart the PS with the site's)"
            )
        with self._cond:
            session_id, rejoin = self.sessions.join(request)
            logger.info("site %s joined (session %s..., version %d)", request.site, session_id[:8], self.version)
            return m.JoinReply(session_id, rejoin, self.version, self.initialized, self.settings)

    def heartbeat(self, request: m.HeartbeatRequest) -> m.HeartbeatReply:
        with self._cond:
            session = self.sessions.get(request.session_id)
            if request.val_loss > 0 and math.isfinite(request.val_loss):
                self.val_losses[session.site] = (request.version, request.val_loss)
                self._site_metrics(session.site, {"val/loss": request.val_loss, "sync/version": request.version})
            if request.leaving:
                self.sessions.leave(request.session_id)
            self._maybe_close()
            pushed = self.rounds.pushed
            waiting = self.cfg.aggregation == "sync" and bool(pushed) and request.session_id not in pushed
            return m.HeartbeatReply(self.version, sync_now=waiting, push=self._push_state(request.push_id))

    def _push_state(self, push_id: str) -> str:
        """What a site asking about its unanswered push learns (hold the lock): applied, still arriving, or not
        held (never got, refused, or a stream that broke off); the site then knows what of its work is in."""
        if not push_id:
            return ""
        if push_id in self._inflight:
            return "receiving"
        previous = self._push_ids.get(push_id)
        return "applied" if previous is not None and previous.accepted else ""

    def status(self, request: m.StatusRequest) -> m.StatusReply:
        with self._cond:
            now = self._clock()
            sites = [self._site_status(sid, s, now) for sid, s in self.sessions.sessions.items()]
            n = sum(int(v.size) for v in self.params.values()) if self.params else 0
            return m.StatusReply(
                self.version,
                self.initialized,
                self.cfg.aggregation,
                n,
                now - self._started,
                sites,
                self.rounds.count,
                self.cfg.outer_optimizer,
                self.cfg.robust,
                len(self.sessions.active()),
                self.snapshot_version,
                len(self.downlink.versions()),
                len(self._inflight),
            )

    def _site_status(self, sid: str, s: Session, now: float) -> m.SiteStatus:
        last_push = now - s.last_push if s.last_push is not None else -1.0
        return m.SiteStatus(
            s.site,
            sid,
            s.pushes,
            s.last_base_version,
            now - s.last_seen,
            s.tokens,
            s.last_train_loss,
            self.sessions.state(s),
            last_push,
            s.last_staleness,
            s.bytes_received,
            s.version,
            s.refused,
        )

    def stream_model(self, request: m.ModelRequest) -> Iterator[m.Chunk]:
        fault("ps.stream", str(request.min_version))
        wait = request.wait_s if math.isfinite(request.wait_s) else 0.0  # a long-poll never outlives rpc_timeout
        deadline = time.monotonic() + min(max(0.0, wait), self.cfg.rpc_timeout.total_seconds())
        with self._cond:
            session = self.sessions.get(request.session_id)
            while not self._closing and not (self.initialized and self.version >= request.min_version):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=min(left, 1.0))
                self.sessions.get(request.session_id)
                self._maybe_close()
            if not self.initialized:
                raise StaleError("the global model is not initialized yet: push an init first")
            header, payload = self._model_payload(request)
            session.version = header.version
        with self._slot(self._sending, "downloads"):
            yield from to_chunks(header, payload, self.cfg.chunk_bytes)

    @contextmanager
    def _slot(self, limit: threading.BoundedSemaphore, what: str) -> Iterator[None]:
        if not limit.acquire(timeout=self.cfg.rpc_timeout.total_seconds()):
            raise UnavailableError(f"the parameter server is busy with other {what}; retry later")
        try:
            yield
        finally:
            limit.release()

    def push_delta(self, chunks: Iterable[m.Chunk]) -> m.PushReply:
        it = iter(chunks)
        with self._slot(self._receiving, "pushes"):  # a waiting push is held back by flow control, unread
            header, first = first_header(it, self.cfg.max_delta_bytes)
            if not isinstance(header, m.PushHeader):
                raise ProtocolError("a push must start with a push header, not a model header")
            with self._cond:
                session = self.sessions.get(header.session_id)
                if not header.push_id:
                    raise ProtocolError("push header has no push_id: set one so a retransmission is recognised")
                replay = self._replay(header.push_id, session)
                if replay is not None:
                    return replay
                try:
                    self._precheck(header)
                except GeofedError:
                    session.refused += 1
                    raise
                self._inflight.add(header.push_id)
            try:
                path = self.staging.receive(header, first, it)
            except BaseException as exc:
                self._done(session, header.push_id, refused=isinstance(exc, GeofedError))
                raise
        try:
            reply = self._decoders.submit(self._apply_staged, session, header, path).result()
        except BaseException as exc:
            self._done(session, header.push_id, refused=isinstance(exc, GeofedError))
            raise
        finally:
            path.unlink(missing_ok=True)
        self._done(session, header.push_id, refused=False)
        return reply

    def _done(self, session: Session, push_id: str, refused: bool) -> None:
        with self._cond:
            session.refused += int(refused)
            self._inflight.discard(push_id)
            self._cond.notify_all()

    def _replay(self, push_id: str, session: Session) -> m.PushReply | None:
        """The reply for a push already handled (waiting while the same push is still being received)."""
        deadline = time.monotonic() + self.cfg.rpc_timeout.total_seconds()
        while push_id in self._inflight:
            if time.monotonic() >= deadline:
                raise UnavailableError(f"push {push_id[:8]} is still being received on another stream; retry")
            self._cond.wait(0.5)
        previous = self._push_ids.get(push_id)
        if previous is None:
            return None
        logger.info("site %s resent push %s; not applied twice", session.site, push_id[:8])
        reason = previous.reason or f"duplicate of push {push_id[:8]}, applied once at version {previous.version}"
        return m.PushReply(previous.accepted, self.version, reason, previous.staleness, True)

    def _precheck(self, h: m.PushHeader) -> None:
        """Refuse what the header alone shows to be wrong, before any payload byte is read (hold the lock)."""
        if h.local_steps < 0 or h.tokens < 0:
            raise ProtocolError(f"local_steps ({h.local_steps}) and tokens ({h.tokens}) cannot be negative")
        if h.init:
            return
        if not self.initialized:
            raise StaleError("the global model is not initialized yet: push an init first")
        if h.base_version > self.version:
            raise StaleError(
                f"base version {h.base_version} is newer than the global version {self.version} (a version from "
                "the future; the PS may have restarted from an older snapshot): pull the model again"
            )
        staleness = self.version - h.base_version
        if staleness > self.cfg.max_staleness:
            raise StaleError(f"delta is {staleness} versions stale (max {self.cfg.max_staleness}): pull again")
        if self.cfg.outer_optimizer == "fednova" and h.local_steps < 1:
            raise ProtocolError("ps.outer_optimizer=fednova normalises by local steps: local_steps must be >= 1")
        if self.cfg.weighting == "tokens" and h.tokens < 1:
            raise ProtocolError("ps.weighting=tokens weights deltas by tokens: tokens must be >= 1")

    def _apply_staged(self, session: Session, header: m.PushHeader, path: Path) -> m.PushReply:
        payload = path.read_bytes()
        if header.init:
            return self._apply_init(session, header, payload)
        journaled = self.journal is not None and self.cfg.aggregation != "async"  # a round that stays open
        if journaled:
            sync_file(path)  # on disk before the journal may take it (outside the lock)
        return self._apply_delta(session, header, payload, path if journaled else None)

    def _decode(self, payload: bytes, header: m.PushHeader, expected: dict | None) -> Params:
        """Decode a verified payload; its bytes arrived intact, so any fault is in what the site sent."""
        try:
            if codec.codec_name(payload) != header.codec:
                raise ProtocolError(f"header says codec {header.codec!r}, payload is {codec.codec_name(payload)!r}")
            return codec.decode(payload, expected=expected)
        except CodecError as exc:
            raise ProtocolError(f"delta refused: {exc}") from None

    def _apply_init(self, session: Session, header: m.PushHeader, payload: bytes) -> m.PushReply:
        params = self._decode(payload, header, None)
        with self._cond:
            if self.initialized:
                reason = f"already initialized at version {self.version}: pull the global model"
                return self._remember(header.push_id, m.PushReply(False, self.version, reason))
            self._seed(params, max(0, header.base_version), f"site {session.site}")
            return self._remember(header.push_id, m.PushReply(True, self.version))

    def _apply_delta(
        self, session: Session, header: m.PushHeader, payload: bytes, staged: Path | None = None
    ) -> m.PushReply:
        """Fold a verified delta into the open round; `staged`: its payload file, journaled while the round is
        open (the reply "accepted" comes after that, so a PS killed later still has it on restart)."""
        nbytes = len(payload)
        prepared = self._prepare(header, payload)
        del payload
        with self._cond:
            staleness = self._admit(prepared, header, session.site, nbytes)
            self._count(session, header, staleness, nbytes)
            self._site_metrics(
                session.site,
                {
                    "sync/bytes_sent": nbytes,
                    "sync/staleness": staleness,
                    "sync/local_steps": header.local_steps,
                    "train/loss": header.train_loss,
                    "site/contribution_tokens": header.tokens,
                    "site/contribution_total": session.tokens,
                },
            )
            # Remembered before the round may close: a snapshot written then must know this push was applied,
            # or its retransmission after a restart from that snapshot would be applied a second time.
            self._remember(header.push_id, m.PushReply(True, self.version, "", staleness))
            open_at = self.version
            self._maybe_close()
            if staged is not None and self.version == open_at:
                self._journal(staged, header, session.site)
            logger.info(
                "push from %s (base %d, staleness %d, norm %.3g, %d bytes) accepted; version %d",
                session.site,
                header.base_version,
                staleness,
                prepared.norm,
                nbytes,
                self.version,
            )
            return self._remember(header.push_id, m.PushReply(True, self.version, "", staleness))

    def _prepare(self, header: m.PushHeader, payload: bytes) -> Prepared:
        """Decode, check and prepare (clip, normalise, spool) a delta; nothing is folded yet."""
        delta = self._decode(payload, header, self._spec)
        with self._cond:
            self.exchange.check(delta, self.version, self._shapes)  # before folding: it cannot be undone
        return self.rounds.prepare(delta, header.session_id, header.local_steps, header.tokens)

    def _admit(self, prepared: Prepared, header: m.PushHeader, site: str, nbytes: int) -> int:
        """Fold a prepared delta into the open round; its staleness (hold the lock)."""
        staleness = self.version - header.base_version
        if staleness > self.cfg.max_staleness or staleness < 0:
            self.rounds.discard(prepared)
            raise StaleError(f"delta is {staleness} versions stale (max {self.cfg.max_staleness}): pull again")
        self.rounds.admit(prepared, staleness_discount(staleness))
        self._contributions.append(Contribution(site, staleness, header.tokens, nbytes))
        return staleness

    def _count(self, session: Session, header: m.PushHeader, staleness: int, nbytes: int) -> None:
        """A site's push statistics (hold the lock)."""
        session.pushes += 1
        session.tokens += header.tokens
        session.last_base_version = header.base_version
        session.last_train_loss = header.train_loss
        session.last_push, session.last_staleness = self._clock(), staleness
        session.bytes_received += nbytes
        self.pushes_total += 1
        self.bytes_received_total += nbytes

    def _journal(self, staged: Path, header: m.PushHeader, site: str) -> None:
        assert self.journal is not None
        try:
            self.journal.record(staged, header, site, self.version)
        except OSError as exc:  # the delta is in the round already: it stays, only a crash before it closes loses it
            logger.error(
                "could not journal the push from %s (%s): a PS crash before the round closes loses it", site, exc
            )

    def _replay_journal(self) -> None:
        """After a restart: the deltas of the open round the journal kept, folded in again (and their push ids
        remembered, so a site's retransmission is answered as a duplicate)."""
        if self.journal is None:
            return
        replayed = 0
        for entry in self.journal.entries():
            h = entry.header
            if not self.initialized or entry.version != self.version or h.push_id in self._push_ids:
                self.journal.drop(entry)  # a round the snapshot holds already (or of another model)
                continue
            try:
                prepared = self._prepare(h, entry.payload)
                with self._cond:
                    staleness = self._admit(prepared, h, entry.site, len(entry.payload))
                    session = self.sessions.sessions.get(h.session_id)
                    if session is not None:
                        self._count(session, h, staleness, len(entry.payload))
                    self._remember(h.push_id, m.PushReply(True, self.version, "", staleness))
                replayed += 1
            except GeofedError as exc:
                logger.warning("journaled push from %s not replayed: %s", entry.site, exc)
                self.journal.drop(entry)
        if replayed:
            logger.info("open round at version %d: %d journaled delta(s) replayed", self.version, replayed)

    def _remember(self, push_id: str, reply: m.PushReply) -> m.PushReply:
        self._push_ids[push_id] = reply
        while len(self._push_ids) > MAX_REMEMBERED_PUSHES:
            self._push_ids.popitem(last=False)
        return reply
