"""The parameter server's logic behind geofed.v1: sessions, pushes, rounds, model downloads."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from geofed_hpc import codec
from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.config import CodecConfig, PSConfig
from geofed_hpc.errors import AuthError, ProtocolError, StaleError
from geofed_hpc.log import logger
from geofed_hpc.ps.aggregate import MeanAccumulator, Params, apply_update, round_complete, staleness_discount
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import collect, digest, to_chunks

MAX_REMEMBERED_PUSHES = 10_000


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class Session:
    site: str
    rejoin_hash: str
    last_seen: float
    pushes: int = 0
    tokens: int = 0
    last_base_version: int = 0
    last_train_loss: float = 0.0
    leaving: bool = False


@dataclass
class _Round:
    acc: MeanAccumulator = field(default_factory=MeanAccumulator)
    pushed: set[str] = field(default_factory=set)
    deadline: float | None = None


class ParameterServerLogic:
    """Runs in memory (tests call it directly) and behind rpc.server (real gRPC); never opens sockets."""

    def __init__(self, cfg: PSConfig, settings: m.RunSettings, clock=time.monotonic) -> None:
        self.cfg = cfg
        self.settings = settings
        self._clock = clock
        self._started = clock()
        self._cond = threading.Condition()
        self.params: Params | None = None
        self.version = 0
        self.sessions: dict[str, Session] = {}
        self._push_ids: OrderedDict[str, m.PushReply] = OrderedDict()
        self._round = _Round()
        self._model_cache: tuple[int, bytes] | None = None
        self._store = CheckpointStore(Path(cfg.state_dir), prefix="global", keep=2) if cfg.state_dir else None
        if self._store is not None:
            self._restore()

    # ---------------------------------------------------------------- persistence
    def _restore(self) -> None:
        assert self._store is not None
        loaded = self._store.load_latest()
        if loaded is None:
            return
        tensors, meta, path = loaded
        self.params = {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}
        self.version = int(meta["version"])
        logger.info("restored global model version %d (%d tensors) from %s", self.version, len(tensors), path)

    def _snapshot(self) -> None:
        if self._store is not None and self.params is not None:
            self._store.save(self.version, self.params, {"version": self.version, "time": time.time()})

    # ---------------------------------------------------------------- helpers
    @property
    def initialized(self) -> bool:
        return self.params is not None

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise AuthError(f"unknown session {session_id[:8]}...: join again")
        session.last_seen = self._clock()
        session.leaving = False
        return session

    def _active(self) -> set[str]:
        horizon = self._clock() - 3 * self.cfg.round_timeout.total_seconds()
        return {sid for sid, s in self.sessions.items() if not s.leaving and s.last_seen >= horizon}

    def _expected_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        assert self.params is not None
        return {k: (tuple(v.shape), "float32") for k, v in self.params.items()}

    def _new_version(self) -> None:
        self.version += 1
        self._model_cache = None
        self._snapshot()
        self._cond.notify_all()

    # ---------------------------------------------------------------- RPCs
    def join(self, request: m.JoinRequest) -> m.JoinReply:
        rejoin = secrets.token_urlsafe(24)
        with self._cond:
            if request.resume_session:
                old = self.sessions.get(request.resume_session)
                if old is None or not hmac.compare_digest(old.rejoin_hash, _hash(request.token)):
                    raise AuthError("rejoin token is unknown or already used: enroll again with the site token")
                session_id = request.resume_session
                old.rejoin_hash, old.last_seen, old.leaving = _hash(rejoin), self._clock(), False
            else:
                if self.cfg.enroll_token and not hmac.compare_digest(
                    _hash(self.cfg.enroll_token), _hash(request.token)
                ):
                    raise AuthError(f"site {request.site!r}: enrollment token refused")
                session_id = secrets.token_hex(16)
                self.sessions[session_id] = Session(request.site, _hash(rejoin), self._clock())
            logger.info("site %s joined (session %s..., version %d)", request.site, session_id[:8], self.version)
            return m.JoinReply(session_id, rejoin, self.version, self.initialized, self.settings)

    def heartbeat(self, request: m.HeartbeatRequest) -> m.HeartbeatReply:
        with self._cond:
            session = self._session(request.session_id)
            session.leaving = request.leaving
            if request.leaving:
                logger.info("site %s left", session.site)
            self._maybe_close_round()
            waiting = bool(self._round.pushed) and request.session_id not in self._round.pushed
            return m.HeartbeatReply(self.version, sync_now=waiting)

    def status(self, request: m.StatusRequest) -> m.StatusReply:
        with self._cond:
            now = self._clock()
            sites = [
                m.SiteStatus(s.site, sid, s.pushes, s.last_base_version, now - s.last_seen, s.tokens, s.last_train_loss)
                for sid, s in self.sessions.items()
            ]
            n = sum(int(v.size) for v in self.params.values()) if self.params else 0
            return m.StatusReply(
                self.version,
                self.initialized,
                self.settings.aggregation,
                n,
                now - self._started,
                sites,
                self._round.acc.count,
            )

    def stream_model(self, request: m.ModelRequest) -> Iterator[m.Chunk]:
        deadline = self._clock() + max(0.0, request.wait_s)
        with self._cond:
            self._session(request.session_id)
            while not (self.initialized and self.version >= request.min_version):
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._cond.wait(timeout=min(left, 1.0))
                self._maybe_close_round()
            if not self.initialized:
                raise StaleError("the global model is not initialized yet: push an init first")
            version, payload = self._encoded_model()
        header = m.ModelHeader(version, "fp32", len(payload), digest(payload))
        yield from to_chunks(header, payload, self.cfg.chunk_bytes)

    def _encoded_model(self) -> tuple[int, bytes]:
        if self._model_cache is None or self._model_cache[0] != self.version:
            assert self.params is not None
            self._model_cache = (self.version, codec.encode(self.params, CodecConfig(name="fp32")))
        return self._model_cache

    def push_delta(self, chunks: Iterator[m.Chunk]) -> m.PushReply:
        header, payload = collect(chunks, self.cfg.max_delta_bytes)
        if not isinstance(header, m.PushHeader):
            raise ProtocolError("a push must start with a push header")
        with self._cond:
            session = self._session(header.session_id)
            if header.push_id in self._push_ids:
                logger.info("site %s resent push %s; not applied twice", session.site, header.push_id[:8])
                previous = self._push_ids[header.push_id]
                return m.PushReply(previous.accepted, self.version, previous.reason, previous.staleness, True)
            if header.init:
                return self._remember(header.push_id, self._init(session, payload))
            if not self.initialized:
                raise StaleError("the global model is not initialized yet: push an init first")
            staleness = self.version - header.base_version
            if staleness < 0:
                raise ProtocolError(f"base version {header.base_version} is newer than the global {self.version}")
            if staleness > self.cfg.max_staleness:
                raise StaleError(f"delta is {staleness} versions stale (max {self.cfg.max_staleness}): pull again")
            spec = self._expected_spec()
        delta = codec.decode(payload, expected=spec)  # outside the lock: decoding is the slow part
        with self._cond:
            staleness = self.version - header.base_version
            if staleness > self.cfg.max_staleness:
                raise StaleError(f"delta is {staleness} versions stale (max {self.cfg.max_staleness}): pull again")
            self._account(session, header)
            weight = staleness_discount(staleness)
            if self.settings.aggregation == "async":
                assert self.params is not None
                apply_update(self.params, delta, self.cfg.global_lr * weight)
                self._new_version()
            else:
                self._round.acc.fold(delta, weight)
                self._round.pushed.add(header.session_id)
                if self._round.deadline is None:
                    self._round.deadline = self._clock() + self.cfg.round_timeout.total_seconds()
                self._maybe_close_round()
            logger.info(
                "applied push from %s (base %d, staleness %d, %d bytes) -> version %d",
                session.site,
                header.base_version,
                staleness,
                len(payload),
                self.version,
            )
            return self._remember(header.push_id, m.PushReply(True, self.version, "", staleness))

    def _init(self, session: Session, payload: bytes) -> m.PushReply:
        if self.initialized:
            return m.PushReply(False, self.version, "already initialized")
        self.params = codec.decode(payload)
        self._snapshot()
        self._cond.notify_all()
        logger.info("global model initialized by %s: %d tensors", session.site, len(self.params))
        return m.PushReply(True, self.version)

    def _account(self, session: Session, header: m.PushHeader) -> None:
        session.pushes += 1
        session.tokens += header.tokens
        session.last_base_version = header.base_version
        session.last_train_loss = header.train_loss

    def _remember(self, push_id: str, reply: m.PushReply) -> m.PushReply:
        self._push_ids[push_id] = reply
        while len(self._push_ids) > MAX_REMEMBERED_PUSHES:
            self._push_ids.popitem(last=False)
        return reply

    def _maybe_close_round(self) -> None:
        r = self._round
        if not round_complete(r.pushed, self._active(), self._clock(), r.deadline):
            return
        assert self.params is not None
        count = r.acc.count
        apply_update(self.params, r.acc.mean(), self.cfg.global_lr)
        self._round = _Round()
        self._new_version()
        logger.info("round closed with %d deltas -> version %d", count, self.version)

    def tick(self) -> None:
        """Close a sync round whose deadline passed; called periodically by the server loop."""
        with self._cond:
            self._maybe_close_round()
