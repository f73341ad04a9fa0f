"""The parameter server's RPCs behind geofed.v1: joins, heartbeats, status, model downloads and pushes."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from geofed_hpc.config import CodecConfig, PSConfig
from geofed_hpc.errors import GeofedError, MismatchError, ProtocolError, UnavailableError
from geofed_hpc.faults import fault
from geofed_hpc.paradigms.exchange import Exchange
from geofed_hpc.ps.aggregate import Delta
from geofed_hpc.ps.coordinator import Coordinator
from geofed_hpc.ps.grouped import GroupedCoordinator
from geofed_hpc.ps.ingest import Ingest
from geofed_hpc.ps.journal import sync_file
from geofed_hpc.ps.sessions import Session
from geofed_hpc.ps.staging import Staging, decode_delta, decode_push
from geofed_hpc.ps.strategy import Strategy
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import first_header, to_chunks

if TYPE_CHECKING:  # the server part imports torch: only a PS of a split paradigm loads it (ps/app.py)
    from geofed_hpc.ps.split.service import SplitService


class ParameterServerLogic:
    """The PS's five RPCs, in memory (tests call it directly) or behind rpc.server (real gRPC); never opens
    sockets. It checks what arrives, bounds how much arrives at once, and hands verified deltas to the
    coordinator (`core`, coordinator.py), which owns the PS's state and its lock.

    A push is decoded as it arrives (`ingest`, ingest.py: frames go to a decoder thread while the handler thread
    verifies length and sha256; nothing is used before the stream verified) when one of `ps.decode_threads`
    decoder slots is free; otherwise it is received into a staging file (`staging`), verified, and decoded by a pool
    of as many threads once a slot frees. Decoding never runs on the gRPC handler threads (each thread's malloc
    arena keeps about the largest thing it once decoded). Memory is bounded by limits, not by the number of sites:
    at most `ps.max_concurrent_pushes` streams are read, `ps.decode_threads` deltas decoded and
    `ps.max_concurrent_downloads` sent at once; the others wait.

    Lock: none of its own; the semaphores bound the streams and decoders, the coordinator's lock guards all state.
    """

    def __init__(
        self,
        cfg: PSConfig,
        settings: m.RunSettings,
        clock: Callable[[], float] = time.monotonic,
        exchange: Exchange | None = None,
        codec: CodecConfig | None = None,
    ) -> None:
        self.cfg = cfg
        state = Path(cfg.state_dir).expanduser() if cfg.state_dir else None
        self.staging = Staging(cfg.staging_dir or (state / "staging" if state else None))
        self._receiving = threading.BoundedSemaphore(cfg.max_concurrent_pushes)
        self._sending = threading.BoundedSemaphore(cfg.max_concurrent_downloads)
        self._decoders = ThreadPoolExecutor(cfg.decode_threads, thread_name_prefix="ps-decode")
        self.ingest = Ingest(cfg.decode_threads, self.staging)
        try:
            kind = GroupedCoordinator if cfg.grouped else Coordinator
            self.core = kind(cfg, settings, self.staging, clock, exchange, codec)
        except BaseException:
            self.staging.close()
            raise
        self.split_part: SplitService | None = None  # fsl_sage / split: the server part (ps/split/), attached

    # ---------------------------------------------------------------- RPCs
    def join(self, request: m.JoinRequest) -> m.JoinReply:
        theirs, ours = request.paradigm or "identity", self.core.settings.paradigm
        if theirs != ours:
            raise MismatchError(
                f"site {request.site} is configured with paradigm {theirs}, this parameter server with {ours}: "
                "give the site the PS's paradigm settings (or restart the PS with the site's)"
            )
        return self.core.join(request)

    def heartbeat(self, request: m.HeartbeatRequest) -> m.HeartbeatReply:
        return self.core.heartbeat(request)

    def status(self, request: m.StatusRequest) -> m.StatusReply:
        return self.core.status()

    def stream_model(self, request: m.ModelRequest) -> Iterator[m.Chunk]:
        fault("ps.stream", str(request.min_version))
        wait = request.wait_s if math.isfinite(request.wait_s) else 0.0  # a long-poll never outlives rpc_timeout
        deadline = time.monotonic() + min(max(0.0, wait), self.cfg.rpc_timeout.total_seconds())
        header, payload = self.core.wait_model(request, deadline)
        with self._slot(self._sending, "downloads"):
            yield from to_chunks(header, payload, self.cfg.chunk_bytes)

    def push_delta(self, chunks: Iterable[m.Chunk]) -> m.PushReply:
        it = iter(chunks)
        with self._slot(self._receiving, "pushes"):  # a waiting push is held back by flow control, unread
            header, first = first_header(it, self.cfg.max_delta_bytes)
            if not isinstance(header, m.PushHeader):
                raise ProtocolError("a push must start with a push header, not a model header")
            session, replay = self.core.begin_push(header)
            if replay is not None:
                return replay
            scratch = None if header.init else self.ingest.take()
            try:
                if scratch is not None:
                    reply = self.ingest.receive(
                        scratch,
                        header,
                        first,
                        it,
                        self.core.model.spec,
                        self.core.journals,
                        lambda delta, nbytes, staged: self._admit(session, header, delta, nbytes, staged),
                    )
                else:
                    path = self.staging.receive(header, first, it)
            except BaseException as exc:
                self.core.end_push(session, header.push_id, refused=isinstance(exc, GeofedError))
                raise
        if scratch is not None:
            self.core.end_push(session, header.push_id, refused=False)
            return self.core.settled(reply, header)
        try:
            reply = self._decoders.submit(self._apply_staged, session, header, path).result()
        except BaseException as exc:
            self.core.end_push(session, header.push_id, refused=isinstance(exc, GeofedError))
            raise
        finally:
            path.unlink(missing_ok=True)
        self.core.end_push(session, header.push_id, refused=False)
        return self.core.settled(reply, header)

    @contextmanager
    def _slot(self, limit: threading.BoundedSemaphore, what: str) -> Iterator[None]:
        if not limit.acquire(timeout=self.cfg.rpc_timeout.total_seconds()):
            raise UnavailableError(f"the parameter server is busy with other {what}; retry later")
        try:
            yield
        finally:
            limit.release()

    def _apply_staged(self, session: Session, header: m.PushHeader, path: Path) -> m.PushReply:
        """On a decoder thread, holding a decoder slot: decode a verified staged push and hand it to the
        coordinator."""
        with self.ingest.held():
            payload = path.read_bytes()
            if header.init:
                return self.core.seed_from(session, header, decode_push(payload, header, None))
            journaled = self.core.journals
            if journaled:
                sync_file(path)  # on disk before the journal may take it (outside the lock)
            nbytes = len(payload)
            delta = decode_delta(payload, header, self.core.model.spec)
            del payload
            return self._admit(session, header, delta, nbytes, path if journaled else None)

    def _admit(
        self, session: Session, header: m.PushHeader, delta: Delta, nbytes: int, staged: Path | None
    ) -> m.PushReply:
        """Hand a verified, decoded delta to the coordinator (`staged`: its payload file, to journal)."""
        return self.core.admit(session, header, delta, nbytes, staged)

    # ---------------------------------------------------------------- split learning (ps/split/)
    def split(self, chunks: Iterable[m.Chunk]) -> Iterator[m.Chunk]:
        return self._split_part().split(chunks)

    def fetch_aux(self, request: m.AuxRequest) -> Iterator[m.Chunk]:
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
