"""Site sessions: enrollment and one-time rejoin tokens, liveness, per-site counters, JSON state."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from geofed_hpc.errors import AuthError
from geofed_hpc.log import logger
from geofed_hpc.rpc import messages as m


def token_hash(token: str) -> str:
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
    last_push: float | None = None
    last_staleness: int = 0
    bytes_received: int = 0
    version: int = 0
    refused: int = 0


# Fields that survive a restart (clock readings do not: monotonic clocks restart with the process).
_PERSISTED = ("site", "rejoin_hash", "pushes", "tokens", "last_base_version", "last_train_loss", "version", "refused")


class SessionTable:
    """Every session the PS knows; not thread-safe (the servicer holds its lock around every call)."""

    def __init__(self, enroll_token: str, clock: Callable[[], float], idle_after: float) -> None:
        self._enroll_hash = token_hash(enroll_token) if enroll_token else ""
        self._clock = clock
        self.idle_after = idle_after
        self.sessions: dict[str, Session] = {}

    def join(self, request: m.JoinRequest) -> tuple[str, str]:
        """(session id, fresh one-time rejoin token); raise AuthError for a bad or used token."""
        rejoin = secrets.token_urlsafe(24)
        now = self._clock()
        if request.resume_session:
            old = self.sessions.get(request.resume_session)
            if old is None or not hmac.compare_digest(old.rejoin_hash, token_hash(request.token)):
                raise AuthError("rejoin token is unknown or already used: enroll again with the site token")
            old.rejoin_hash, old.last_seen, old.leaving = token_hash(rejoin), now, False
            return request.resume_session, rejoin
        if self._enroll_hash and not hmac.compare_digest(self._enroll_hash, token_hash(request.token)):
            raise AuthError(f"site {request.site!r}: enrollment token refused (check site.token)")
        session_id = secrets.token_hex(16)
        self.sessions[session_id] = Session(request.site, token_hash(rejoin), now)
        return session_id, rejoin

    def get(self, session_id: str) -> Session:
        """The session, marked as seen now; AuthError when unknown."""
        session = self.sessions.get(session_id)
        if session is None:
            raise AuthError(f"unknown session {session_id[:8]}...: join again")
        session.last_seen = self._clock()
        session.leaving = False
        return session

    def state(self, session: Session) -> str:
        if session.leaving:
            return "left"
        return "active" if self._clock() - session.last_seen <= self.idle_after else "idle"

    def active(self) -> set[str]:
        return {sid for sid, s in self.sessions.items() if self.state(s) == "active"}

    def leave(self, session_id: str) -> None:
        session = self.get(session_id)
        session.leaving = True
        logger.info("site %s left", session.site)

    def to_json(self) -> list[dict[str, Any]]:
        return [{"id": sid, **{k: getattr(s, k) for k in _PERSISTED}} for sid, s in self.sessions.items()]

    def load_json(self, rows: list[dict[str, Any]]) -> None:
        """Restore sessions saved by to_json; they count as just seen, so rejoins and rounds work at once."""
        now = self._clock()
        names = {f.name for f in dataclasses.fields(Session)}
        for row in rows:
            values = {k: v for k, v in row.items() if k in names and k in _PERSISTED}
            self.sessions[str(row["id"])] = Session(last_seen=now, **values)
