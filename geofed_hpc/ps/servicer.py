"""The parameter server's RPCs behind geofed.v1: joins, heartbeats, status, model downloads and pushes."""

from __future__ import annotations

import hmac
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from geofed_hpc.config import CodecConfig, PSConfig
from geofed_hpc.errors import AuthError, ConfigError, GeofedError, MismatchError, ProtocolError
from geofed_hpc.faults import fault
from geofed_hpc.log import escape
from geofed_hpc.paradigms.exchange import Exchange
from geofed_hpc.ps.aggregate import Delta
from geofed_hpc.ps.coordinator import Coordinator
from geofed_hpc.ps.gate import Gate
from geofed_hpc.ps.grouped import GroupedCoordinator
from geofed_hpc.ps.ingest import Ingest
from geofed_hpc.ps.journal import sync_file
from geofed_hpc.ps.pulls import payload_chunks
from geofed_hpc.ps.remote import local_state
from geofed_hpc.ps.sessions import Session
from geofed_hpc.ps.slots import FairSlots
from geofed_hpc.ps.staging import Staging, decode_delta, decode_push
from geofed_hpc.ps.statedir import admin_token
from geofed_hpc.ps.strategy import Strategy
from geofed_hpc.ps.tokens import check_site_name, family_of
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.guard import Caller
from geofed_hpc.rpc.stream import first_header

if TYPE_CHECKING:  # the server part imports torch: only a PS of a split paradigm loads it (ps/app.py)
    from geofed_hpc.ps.split.service import SplitService


class ParameterServerLogic:
    """The PS's RPCs, in memory (tests call them directly) or behind rpc.server (real gRPC, whose gate asks `gate`,
    gate.py, who each caller is and what it may hold before the call starts); never opens sockets. It checks what
    arrives, bounds how much arrives at once, and hands verified deltas to the coordinator (`core`,
    coordinator.py), which owns the PS's state and its lock.

    A push is decoded as it arrives (`ingest`, ingest.py: frames go to a decoder thread while the handler thread
    verifies length and sha256; nothing is used before the stream verified) when one of `ps.decode_threads`
    decoder slots is free; otherwise it is received into a staging file (`staging`), verified, and decoded by a pool
    of as many threads once a slot frees. Decoding never runs on the gRPC handler threads (each thread's malloc
    arena keeps about the largest thing it once decoded). Memory is bounded by limits, not by the number of sites:
    at most `ps.max_concurrent_pushes` streams are read, `ps.decode_threads` deltas decoded and
    `ps.max_concurrent_downloads` sent at once; the others wait. While sites of several families take part, one
    family (a site and its numbered jobs) never takes the last quarter of each (slots.py), so that its pushes that
    stall or downloads nobody reads leave the others room.

    Lock: none of its own; the slots bound the streams and decoders, the coordinator's lock guards all state.
    """

    def __init__(
        self,
        cfg: PSConfig,
        settings: m.RunSettings,
        clock: Callable[[], float] = time.monotonic,
        exchange: Exchange | None = None,
        codec: CodecConfig | None = None,
        admin: str = "",
    ) -> None:
        self.cfg = cfg
        state = local_state(cfg)
        self.staging = Staging(cfg.staging_dir or (state / "staging" if state else None))
        try:
            kind = GroupedCoordinator if cfg.grouped else Coordinator
            self.core = kind(cfg, settings, self.staging, clock, exchange, codec)
        except BaseException:
            self.staging.close()
            raise
        # with sites of several families, one family never takes the last quarter of these (slots.py)
        contended = self.core.sessions.several_families
        self._receiving = FairSlots(cfg.max_concurrent_pushes, contended=contended)
        self._sending = FairSlots(cfg.max_concurrent_downloads, contended=contended)
        self._decoders = ThreadPoolExecutor(cfg.decode_threads, thread_name_prefix="ps-decode")
        self.ingest = Ingest(cfg.decode_threads, self.staging, contended)
        self.split_part: SplitService | None = None  # fsl_sage / split: the server part (ps/split/), attached
        if state is not None and not admin:  # the operator's credential, kept in the state directory (0600)
            admin = admin_token(state, create=True)
        self.gate = Gate(cfg, self.core.sessions, admin)  # who may call, and how much each may hold

    # ---------------------------------------------------------------- RPCs
    # `caller`: who calls over gRPC (rpc/server.py, after the gate admitted the call); None in process (tests).
    def join(self, request: m.JoinRequest, caller: Caller | None = None) -> m.JoinReply:
        if caller is not None and not hmac.compare_digest(caller.credential.encode(), request.token.encode()):
            raise AuthError("Join: the token in the request is not the one the call carries")
        try:
            check_site_name(request.site)
        except ConfigError as exc:
            raise ProtocolError(str(exc)) from None
        self.gate.check_site(caller, request.site)
        theirs, ours = request.paradigm or "identity", self.core.settings.paradigm
        if theirs != ours:
            raise MismatchError(
                f"site {request.site} is configured with paradigm {escape(theirs, 200)}, this parameter server "
                f"with {ours}: give the site the PS's paradigm settings (or restart the PS with the site's)"
            )
        return self.core.join(request)

    def heartbeat(self, request: m.HeartbeatRequest, caller: Caller | None = None) -> m.HeartbeatReply:
        _same_session(request.session_id, caller)
        return self.core.heartbeat(request)

    def status(self, request: m.StatusRequest, caller: Caller | None = None) -> m.StatusReply:
        reply = self.core.status(handles=caller is None or caller.principal.kind == "admin")
        reply.streams = self.gate.streams
        if caller is not None and caller.principal.kind in ("enroll", "session"):
            reply.caller_site = caller.principal.site  # what a launch's preflight checks its token against
        return reply

    def stream_model(self, request: m.ModelRequest, caller: Caller | None = None) -> Iterator[m.Chunk]:
        _same_session(request.session_id, caller)
        fault("ps.stream", str(request.min_version))
        wait = request.wait_s if math.isfinite(request.wait_s) else 0.0  # a long-poll never outlives rpc_timeout
        deadline = time.monotonic() + min(max(0.0, wait), self.cfg.rpc_timeout.total_seconds())
        family = family_of(self.core.session_site(request.session_id))
        header, payload = self.core.wait_model(request, deadline, caller)
        with self._sending.held(family, self.cfg.stream_idle_timeout, "downloads", _ended(caller)):
            yield from payload_chunks(header, payload, self.cfg.chunk_bytes)

    def push_delta(self, chunks: Iterable[m.Chunk], caller: Caller | None = None) -> m.PushReply:
        it = iter(chunks)
        if caller is None:  # in process: the pushing session's family is known once the header is read
            received = self._receive(it, None)
        else:  # over gRPC the gate proved the session's site: its slot is waited for before any byte is read
            with self._receiving_slot(caller.principal.site, caller):
                received = self._receive(it, caller)
        if isinstance(received, m.PushReply):
            return received  # a resent push, answered from memory
        session, header, reply, path = received
        if reply is not None:  # decoded as it arrived
            self.core.end_push(session, header.push_id, refused=False)
            return self.core.settled(reply, header)
        assert path is not None
        try:
            reply = self._decoders.submit(self._apply_staged, session, header, path).result()
        except BaseException as exc:
            self.core.end_push(session, header.push_id, refused=isinstance(exc, GeofedError))
            raise
        finally:
            path.unlink(missing_ok=True)
        self.core.end_push(session, header.push_id, refused=False)
        return self.core.settled(reply, header)

    def _receiving_slot(self, site: str, caller: Caller | None) -> AbstractContextManager[None]:
        """One of the ps.max_concurrent_pushes pushes read at once: the others wait, held back by flow control, for
        ps.stream_idle_timeout at most (then RESOURCE_EXHAUSTED with a retry hint: a push that waits holds a handler
        thread, and no push is kept waiting longer than a stalled one is)."""
        return self._receiving.held(family_of(site), self.cfg.stream_idle_timeout, "pushes", _ended(caller))

    def _receive(
        self, it: Iterator[m.Chunk], caller: Caller | None
    ) -> m.PushReply | tuple[Session, m.PushHeader, m.PushReply | None, Path | None]:
        """Read a push's header, then its payload: the reply of a resent push, or (session, header, and the reply of
        a push decoded as it arrived or the staged file of one to decode). Holds a receiving slot while it reads
        (over gRPC, `caller`'s, taken already)."""
        header, first = first_header(it, self.cfg.max_delta_bytes)
        if not isinstance(header, m.PushHeader):
            raise ProtocolError("a push must start with a push header, not a model header")
        _same_session(header.session_id, caller)
        session, replay = self.core.begin_push(header)
        if replay is not None:
            return replay
        header = replace(header, session_id=session.handle)  # from here on the session is named, never its secret
        try:
            with self._receiving_slot(session.site, None) if caller is None else nullcontext():
                family = family_of(session.site)
                scratch = None if header.init else self.ingest.take(family)
                if scratch is None:
                    return session, header, None, self.staging.receive(header, first, it)
                reply = self.ingest.receive(
                    scratch,
                    header,
                    first,
                    it,
                    self.core.model.spec,
                    self.core.journals,
                    lambda delta, nbytes, staged: self._admit(session, header, delta, nbytes, staged),
                )
                return session, header, reply, None
        except BaseException as exc:
            self.core.end_push(session, header.push_id, refused=isinstance(exc, GeofedError))
            raise

    def _apply_staged(self, session: Session, header: m.PushHeader, path: Path) -> m.PushReply:
        """On a decoder thread, holding a decoder slot: decode a verified staged push and hand it to the
        coordinator."""
        with self.ingest.held() as scratch:
            payload = path.read_bytes()
            if header.init:
                return self.core.seed_from(session, header, decode_push(payload, header, None))
            journaled = self.core.journals
            if journaled:
                sync_file(path)  # on disk before the journal may take it (outside the lock)
            nbytes = len(payload)
            delta = decode_delta(payload, header, self.core.model.spec, scratch)  # admitted before the slot frees
            del payload
            return self._admit(session, header, delta, nbytes, path if journaled else None)

    def _admit(
        self, session: Session, header: m.PushHeader, delta: Delta, nbytes: int, staged: Path | None
    ) -> m.PushReply:
        """Hand a verified, decoded delta to the coordinator (`staged`: its payload file, to journal)."""
        return self.core.admit(session, header, delta, nbytes, staged)

    # ---------------------------------------------------------------- split learning (ps/split/)
    def split(self, chunks: Iterable[m.Chunk], caller: Caller | None = None) -> Iterator[m.Chunk]:
        it = iter(chunks)
        first = next(it, None)
        if first is not None and first.split is not None:
            _same_session(first.split.session_id, caller)
        return self._split_part().split(itertools.chain([first] if first is not None else [], it))

    def fetch_aux(self, request: m.AuxRequest, caller: Caller | None = None) -> Iterator[m.Chunk]:
        _same_session(request.session_id, caller)
        return self._split_part().fetch_aux(request)

    def _split_part(self) -> SplitService:
        if self.split_part is None:
            raise MismatchError(
                f"this parameter server runs paradigm {self.core.settings.paradigm}: it has no server part "
                "(split learning needs paradigm=fsl_sage or paradigm=split on the PS and the sites)"
            )
        return self.split_part

    # ---------------------------------------------------------------- lifecycle and views (ps/app.py, `ps up`)
    def tick(self) -> None:
        """Close a round whose deadline passed; called periodically by the server loop."""
        self.core.tick()

    def begin_shutdown(self) -> None:
        """Stop long-polls from waiting (they answer with what they have); pushes in flight go on."""
        self.core.begin_shutdown()

    def finish(self, wait: timedelta = timedelta(seconds=10)) -> None:
        """After the server stopped: wait for pushes still applying, apply the open round, snapshot, clean up."""
        self.core.finish(wait)
        self._decoders.shutdown(wait=True)
        self.ingest.close()
        self.staging.close()

    @property
    def version(self) -> int:
        return self.core.model.version

    @property
    def initialized(self) -> bool:
        return self.core.model.initialized

    @property
    def snapshot_version(self) -> int:
        """The version the newest snapshot written holds (-1: none)."""
        return self.core.persistence.snapshot_version

    @property
    def rounds(self) -> Strategy:
        """The aggregation strategy and its open round (`rounds.count`: the deltas waiting in it)."""
        return self.core.strategy

    def model_hash(self) -> str:
        """sha256 over the global model's names and bytes (tests compare it before and after bad input)."""
        return self.core.model_hash()

    def applied_since(self, version: int) -> list[dict]:
        """The kept global updates after `version`, oldest first, as plain dicts (`ps up`'s progress table)."""
        return self.core.observer.applied_since(version)

    def global_val_loss(self) -> tuple[int, float]:
        """The newest version any site evaluated and the sites' mean validation loss for it ((-1, nan): none)."""
        return self.core.observer.global_val_loss()

    def ps_metrics(self) -> dict[str, float | int]:
        """The ps/* metric values now."""
        return self.core.ps_metrics()


def _same_session(credential: str, caller: Caller | None) -> None:
    """Over gRPC, the session a request names must be the one its call proved (the gate checked the call's
    credential before the call started; the coordinator checks the request's when it uses it)."""
    if caller is not None and not hmac.compare_digest(caller.credential.encode(), credential.encode()):
        raise AuthError("the session named in the request is not the one the call carries")


def _ended(caller: Caller | None) -> Callable[[], bool]:
    """Whether the call ended (its caller gave up, or the PS ended it): a wait for a slot stops then."""
    return (lambda: caller.ended) if caller is not None else (lambda: False)
