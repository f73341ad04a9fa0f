"""Site sessions: enrollment and one-time rejoin tokens, session limits, liveness, per-site counters, JSON state."""

from __future__ import annotations

import dataclasses
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from geofed_hpc.errors import AuthError, ConfigError, LimitError, ProtocolError
from geofed_hpc.log import logger
from geofed_hpc.ps.tokens import TokenVerifier, check_site_name, token_hash
from geofed_hpc.rpc import messages as m

MAX_TOKEN_CHARS = 512


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
    token_id: str = ""  # the enrollment token it joined with ("": ps.enroll_token or an open PS)


# Fields that survive a restart (clock readings do not: monotonic clocks restart with the process).
_PERSISTED = (
    "site",
    "rejoin_hash",
    "pushes",
    "tokens",
    "last_base_version",
    "last_train_loss",
    "version",
    "refused",
    "token_id",
    "leaving",  # a site that said it leaves is not waited for after a restart either
)


class SessionTable:
    """Every session the PS knows, at most `max_sessions` (and `per_site` per site name): at a limit the least
    recently seen inactive session makes room, and when all are active a new enrollment is refused.

    Lock: none; not thread-safe. The coordinator's lock guards every call."""

    def __init__(
        self,
        verifier: TokenVerifier,
        clock: Callable[[], float],
        idle_after: float,
        max_sessions: int = 4096,
        per_site: int = 8,
    ) -> None:
        self.verifier = verifier
        self._clock = clock
        self.idle_after = idle_after
        self.max_sessions, self.per_site = max_sessions, per_site
        self.sessions: dict[str, Session] = {}

    def join(self, request: m.JoinRequest) -> tuple[str, str]:
        """(session id, fresh one-time rejoin token); raise AuthError for a bad, used or revoked token."""
        try:
            check_site_name(request.site)
        except ConfigError as exc:
            raise ProtocolError(str(exc)) from None
        if len(request.token) > MAX_TOKEN_CHARS:
            raise self._refused(request, f"token of {len(request.token)} characters refused")
        rejoin = secrets.token_urlsafe(24)
        now = self._clock()
        if request.resume_session:
            old = self.sessions.get(request.resume_session)
            if (
                old is None
                or old.site != request.site
                or not hmac.compare_digest(old.rejoin_hash, token_hash(request.token))
            ):
                raise self._refused(
                    request, "rejoin token is unknown or already used: enroll again with the site token"
                )
            self._check_revoked(request.resume_session, old)
            old.rejoin_hash, old.last_seen, old.leaving = token_hash(rejoin), now, False
            return request.resume_session, rejoin
        try:
            token_id = self.verifier.check(request.site, request.token)
        except AuthError as exc:
            raise self._refused(request, str(exc)) from None
        self._make_room(request.site)
        session_id = secrets.token_hex(16)
        self.sessions[session_id] = Session(request.site, token_hash(rejoin), now, token_id=token_id)
        return session_id, rejoin

    def _refused(self, request: m.JoinRequest, why: str) -> AuthError:
        logger.warning("join refused: %s (site %r%s)", why, request.site, ", rejoin" if request.resume_session else "")
        return AuthError(why)

    def _check_revoked(self, session_id: str, session: Session) -> None:
        if self.verifier.revoked(session.token_id):
            del self.sessions[session_id]
            logger.warning(
                "site %r: session %s... ended, its token %s was revoked", session.site, session_id[:8], session.token_id
            )
            raise AuthError(f"site {session.site!r}: its enrollment token {session.token_id} was revoked")

    def _make_room(self, site: str) -> None:
        """Drop the least recently seen inactive session of `site` (or of anyone) at a limit; LimitError if none."""
        per_site = [sid for sid, s in self.sessions.items() if s.site == site]
        for limit, pool, key in (
            (self.per_site, per_site, "ps.max_sessions_per_site"),
            (self.max_sessions, list(self.sessions), "ps.max_sessions"),
        ):
            if len(pool) < limit:
                continue
            idle = [sid for sid in pool if self.state(self.sessions[sid]) != "active"]
            if not idle:
                raise LimitError(
                    f"site {site!r}: {len(pool)} sessions are active ({key}={limit}); rejoin with the rejoin "
                    "token instead of enrolling again, or retry when one has gone idle"
                )
            oldest = min(idle, key=lambda sid: self.sessions[sid].last_seen)
            logger.info("session %s... of site %r dropped (%s=%d)", oldest[:8], self.sessions[oldest].site, key, limit)
            del self.sessions[oldest]

    def get(self, session_id: str) -> Session:
        """The session, marked as seen now; AuthError when unknown or when its enrollment token was revoked."""
        session = self.sessions.get(session_id)
        if session is None:
            raise AuthError(f"unknown session {session_id[:8]}...: join again")
        self._check_revoked(session_id, session)
        session.last_seen = self._clock()
        session.leaving = False
        return session

    def state(self, session: Session) -> str:
        if session.leaving:
            return "left"
        return "active" if self._clock() - session.last_seen <= self.idle_after else "idle"

    def active(self) -> set[str]:
        return {sid for sid, s in self.sessions.items() if self.state(s) == "active"}

    def rows(self, now: float) -> list[m.SiteStatus]:
        """One status row per session (`now`: the table's clock reading)."""
        return [
            m.SiteStatus(
                s.site,
                sid,
                s.pushes,
                s.last_base_version,
                now - s.last_seen,
                s.tokens,
                s.last_train_loss,
                self.state(s),
                now - s.last_push if s.last_push is not None else -1.0,
                s.last_staleness,
                s.bytes_received,
                s.version,
                s.refused,
            )
            for sid, s in self.sessions.items()
        ]

    def pushed(self, session: Session, header: m.PushHeader, staleness: int, nbytes: int) -> None:
        """Count a push applied to the open round in its site's statistics."""
        session.pushes += 1
        session.tokens += header.tokens
        session.last_base_version = header.base_version
        session.last_train_loss = header.train_loss
        session.last_push, session.last_staleness = self._clock(), staleness
        session.bytes_received += nbytes

    def leave(self, session_id: str) -> None:
        session = self.get(session_id)
        session.leaving = True
        logger.info("site %s left", session.site)

    def quiet(self) -> None:
        """Count every session idle until it is seen again (a PS that took a PS group's state: its sites may have
        moved to a peer meanwhile, and a round must not wait for them)."""
        for session in self.sessions.values():
            session.last_seen = self._clock() - self.idle_after - 1.0

    def to_json(self) -> list[dict[str, Any]]:
        return [{"id": sid, **{k: getattr(s, k) for k in _PERSISTED}} for sid, s in self.sessions.items()]

    def load_json(self, rows: list[dict[str, Any]]) -> None:
        """Restore sessions saved by to_json; they count as just seen, so rejoins and rounds work at once."""
        now = self._clock()
        names = {f.name for f in dataclasses.fields(Session)}
        for row in rows:
            values = {k: v for k, v in row.items() if k in names and k in _PERSISTED}
            self.sessions[str(row["id"])] = Session(last_seen=now, **values)
