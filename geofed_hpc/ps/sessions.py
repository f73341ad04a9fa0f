"""Site sessions: credentials (a public handle and a secret), one-time rejoin tokens, limits, liveness, JSON state."""

from __future__ import annotations

import dataclasses
import hmac
import re
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from geofed_hpc.errors import AuthError, CheckpointError, ConfigError, LimitError, ProtocolError
from geofed_hpc.log import logger, quote
from geofed_hpc.ps.tokens import TokenVerifier, check_site_name, family_of, token_hash
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.guard import Principal

MAX_TOKEN_CHARS = 512
SESSION_PREFIX = "gfs"
# gfs_<handle: 16 hex, public: logs, status, snapshots>_<secret: 192 random bits, known only to the site>
_CREDENTIAL = re.compile(rf"{SESSION_PREFIX}_([0-9a-f]{{16}})_([A-Za-z0-9_-]{{16,64}})")
_HANDLE = re.compile(r"[0-9a-f]{16}|[0-9a-f]{32}")  # (32: the session id of older versions, its own secret)


def new_credential(handle: str = "") -> tuple[str, str, str]:
    """(handle, credential, hash of its secret) for a new session, or a new secret for the session `handle`."""
    handle = handle or secrets.token_hex(8)
    secret = secrets.token_urlsafe(24)
    return handle, f"{SESSION_PREFIX}_{handle}_{secret}", token_hash(secret)


def handle_of(text: str) -> str:
    """The session handle a credential (or a handle, or an older version's session id) names; "" for none."""
    match = _CREDENTIAL.fullmatch(text)
    if match is not None:
        return match.group(1)
    return text if _HANDLE.fullmatch(text) else ""


def is_session_credential(text: str) -> bool:
    return _CREDENTIAL.fullmatch(text) is not None


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
    secret_hash: str = ""  # sha256 of the credential's secret ("": a session restored from an older version)
    handle: str = ""  # its public handle, the key it is kept under


# Fields that survive a restart (clock readings do not: monotonic clocks restart with the process). Only hashes of
# secrets: a snapshot that leaks gives no credential.
_PERSISTED: dict[str, type | tuple[type, ...]] = {
    "site": str,
    "rejoin_hash": str,
    "pushes": int,
    "tokens": int,
    "last_base_version": int,
    "last_train_loss": (int, float),
    "version": int,
    "refused": int,
    "token_id": str,
    "leaving": bool,  # a site that said it leaves is not waited for after a restart either
    "secret_hash": str,
}


class SessionTable:
    """Every session the PS knows, by handle, at most `max_sessions` (and `per_site` per site name): at a limit the
    least recently seen inactive session makes room, and when all are active a new enrollment is refused.

    A session's credential (`gfs_<handle>_<secret>`) is the only thing that acts for it: only the hash of its secret
    is kept and compared, in constant time; a rejoin token is good once and gives a new secret; a session that left
    is refused until its site joins again.

    Lock: its own `_lock` (re-entrant), never held while anything waits: the coordinator calls in under its own lock,
    the server's gate (authenticate) without it."""

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
        self._by_rejoin: dict[str, str] = {}  # rejoin token hash -> handle
        self._lock = threading.RLock()
        self._changes = 0  # counts the joins, rejoins, leaves and drops
        self._several = (False, -1)  # several_families, and the count of changes it was worked out at

    # ---------------------------------------------------------------- joining
    def join(self, request: m.JoinRequest) -> tuple[str, str]:
        """(session credential, fresh one-time rejoin token); AuthError for a bad, used or revoked token."""
        try:
            check_site_name(request.site)
        except ConfigError as exc:
            raise ProtocolError(str(exc)) from None
        if len(request.token) > MAX_TOKEN_CHARS:
            raise self._refused(request, f"token of {len(request.token)} characters refused")
        rejoin = secrets.token_urlsafe(24)
        with self._lock:
            now = self._clock()
            if request.resume_session:
                handle = handle_of(request.resume_session)
                old = self.sessions.get(handle)
                if (
                    old is None
                    or old.site != request.site
                    or not hmac.compare_digest(old.rejoin_hash, token_hash(request.token))
                ):
                    raise self._refused(
                        request, "rejoin token is unknown or already used: enroll again with the site token"
                    )
                self._check_revoked(handle, old)
                self._changes += 1
                _, credential, old.secret_hash = new_credential(handle)
                self._set_rejoin(old, token_hash(rejoin))
                old.last_seen, old.leaving = now, False
                return credential, rejoin
            try:
                token_id = self.verifier.check(request.site, request.token)
            except AuthError as exc:
                raise self._refused(request, str(exc)) from None
            self._make_room(request.site)
            handle, credential, secret_hash = new_credential()
            session = Session(request.site, "", now, token_id=token_id, secret_hash=secret_hash, handle=handle)
            self.sessions[handle] = session
            self._changes += 1
            self._set_rejoin(session, token_hash(rejoin))
            return credential, rejoin

    def _set_rejoin(self, session: Session, rejoin_hash: str) -> None:
        self._by_rejoin.pop(session.rejoin_hash, None)
        session.rejoin_hash = rejoin_hash
        self._by_rejoin[rejoin_hash] = session.handle

    def _drop(self, handle: str) -> None:
        session = self.sessions.pop(handle, None)
        if session is not None:
            self._by_rejoin.pop(session.rejoin_hash, None)
            self._changes += 1

    def _refused(self, request: m.JoinRequest, why: str) -> AuthError:
        logger.warning(
            "join refused: %s (site %s%s)", why, quote(request.site), ", rejoin" if request.resume_session else ""
        )
        return AuthError(why)

    def _check_revoked(self, handle: str, session: Session) -> None:
        if self.verifier.revoked(session.token_id):
            self._drop(handle)
            logger.warning(
                "site %r: session %s... ended, its token %s was revoked", session.site, handle[:8], session.token_id
            )
            raise AuthError(f"site {session.site!r}: its enrollment token {session.token_id} was revoked")

    def _make_room(self, site: str) -> None:
        """Drop the least recently seen inactive session of `site` (or of anyone) at a limit; LimitError if none."""
        per_site = [h for h, s in self.sessions.items() if s.site == site]
        for limit, pool, key in (
            (self.per_site, per_site, "ps.max_sessions_per_site"),
            (self.max_sessions, list(self.sessions), "ps.max_sessions"),
        ):
            if len(pool) < limit:
                continue
            idle = [h for h in pool if self.state(self.sessions[h]) != "active"]
            if not idle:
                raise LimitError(
                    f"site {site!r}: {len(pool)} sessions are active ({key}={limit}); rejoin with the rejoin "
                    "token instead of enrolling again, or retry when one has gone idle"
                )
            oldest = min(idle, key=lambda h: self.sessions[h].last_seen)
            logger.info("session %s... of site %r dropped (%s=%d)", oldest[:8], self.sessions[oldest].site, key, limit)
            self._drop(oldest)

    # ---------------------------------------------------------------- credentials
    def _verified(self, credential: str) -> Session:
        """The live session `credential` is for; AuthError when it is for none, or the session left or was revoked."""
        match = _CREDENTIAL.fullmatch(credential)
        session = self.sessions.get(match.group(1)) if match is not None else None
        if (
            match is None
            or session is None
            or not session.secret_hash
            or not hmac.compare_digest(session.secret_hash, token_hash(match.group(2)))
        ):
            named = f" {match.group(1)[:8]}..." if match is not None else ""
            raise AuthError(f"unknown session{named}: join again")
        if session.leaving:
            raise AuthError(f"session {session.handle[:8]}... of site {session.site!r} left; join again")
        self._check_revoked(session.handle, session)
        return session

    def get(self, credential: str) -> Session:
        """The session `credential` is for, marked as seen now; AuthError when it is unknown, its secret is wrong,
        it left, or its enrollment token was revoked."""
        with self._lock:
            session = self._verified(credential)
            session.last_seen = self._clock()
            return session

    def principal(self, credential: str) -> Principal:
        """Who a session credential proves the caller to be (the server's gate, before the call starts)."""
        with self._lock:
            session = self._verified(credential)
            return Principal("session", session.site, session.handle)

    def rejoin_principal(self, token: str) -> Principal | None:
        """The session a one-time rejoin token is (still) good for, or None."""
        if len(token) > MAX_TOKEN_CHARS:
            return None
        with self._lock:
            handle = self._by_rejoin.get(token_hash(token))
            session = self.sessions.get(handle) if handle is not None else None
            return Principal("rejoin", session.site, handle) if session is not None and handle is not None else None

    def several_families(self) -> bool:
        """Sessions of more than one family of sites (a site and its numbered jobs) are live (joined, not left);
        worked out again only after the table changed."""
        with self._lock:
            if self._several[1] != self._changes:
                families = {family_of(s.site) for s in self.sessions.values() if not s.leaving}
                self._several = (len(families) > 1, self._changes)
            return self._several[0]

    # ---------------------------------------------------------------- liveness and counters
    def state(self, session: Session) -> str:
        if session.leaving:
            return "left"
        return "active" if self._clock() - session.last_seen <= self.idle_after else "idle"

    def active(self) -> set[str]:
        """The handles of the sessions seen recently."""
        with self._lock:
            return {h for h, s in self.sessions.items() if self.state(s) == "active"}

    def rows(self, now: float, handles: bool = True) -> list[m.SiteStatus]:
        """One status row per session (`now`: the table's clock reading); `handles`: with each session's public
        handle (no secret is ever in a row)."""
        with self._lock:
            return [
                m.SiteStatus(
                    s.site,
                    h if handles else "",
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
                for h, s in self.sessions.items()
            ]

    def pushed(self, session: Session, header: m.PushHeader, staleness: int, nbytes: int) -> None:
        """Count a push applied to the open round in its site's statistics."""
        with self._lock:
            session.pushes += 1
            session.tokens += header.tokens
            session.last_base_version = header.base_version
            session.last_train_loss = header.train_loss
            session.last_push, session.last_staleness = self._clock(), staleness
            session.bytes_received += nbytes

    def leave(self, credential: str) -> None:
        """The session ends here: every later call with its credential is refused, until its site joins again."""
        with self._lock:
            session = self.get(credential)
            session.leaving = True
            self._changes += 1
        logger.info("site %s left", session.site)

    def quiet(self) -> None:
        """Count every session idle until it is seen again (a PS that took a PS group's state: its sites may have
        moved to a peer meanwhile, and a round must not wait for them)."""
        with self._lock:
            for session in self.sessions.values():
                session.last_seen = self._clock() - self.idle_after - 1.0

    # ---------------------------------------------------------------- state
    def to_json(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"id": h, **{k: getattr(s, k) for k in _PERSISTED}} for h, s in self.sessions.items()]

    def load_json(self, rows: list[dict[str, Any]]) -> None:
        """Restore sessions saved by to_json; they count as just seen, so rejoins and rounds work at once. A row that
        is not what to_json writes: CheckpointError naming it and its field (nothing is restored then)."""
        now = self._clock()
        names = {f.name for f in dataclasses.fields(Session)}
        loaded: dict[str, Session] = {}
        for i, row in enumerate(rows):
            values = _checked_row(i, row)
            handle = values.pop("id")
            loaded[handle] = Session(last_seen=now, handle=handle, **{k: v for k, v in values.items() if k in names})
        with self._lock:
            self._changes += 1
            for handle, session in loaded.items():
                self.sessions[handle] = session
                if session.rejoin_hash:
                    self._by_rejoin[session.rejoin_hash] = handle


def _checked_row(i: int, row: Any) -> dict[str, Any]:
    """A snapshot's session row, its fields' types checked (rows of older versions lack `secret_hash`)."""
    if not isinstance(row, dict):
        raise CheckpointError(f"session {i} is a {type(row).__name__}, not an object")
    handle = row.get("id")
    if not isinstance(handle, str) or not handle_of(handle) == handle:
        raise CheckpointError(f"session {i}: 'id' is {quote(handle, 40)}, not a session handle")
    values: dict[str, Any] = {"id": handle}
    for key, kinds in _PERSISTED.items():
        if key not in row:
            if key in ("secret_hash", "token_id", "leaving"):
                continue  # written by newer versions only; the defaults hold
            raise CheckpointError(f"session {i} ({handle[:8]}...): '{key}' is missing")
        value = row[key]
        if (isinstance(value, bool) and kinds is not bool) or not isinstance(value, kinds):
            raise CheckpointError(f"session {i} ({handle[:8]}...): '{key}' is {quote(value, 40)}")
        values[key] = value
    try:
        check_site_name(values["site"])
    except ConfigError as exc:
        raise CheckpointError(f"session {i} ({handle[:8]}...): {exc}") from None
    return values
