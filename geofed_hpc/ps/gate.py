"""Who may call the parameter server, as whom, and how much each caller may hold at once: the server's gate."""

from __future__ import annotations

import hmac
import threading
from collections import Counter
from collections.abc import Callable

from geofed_hpc.config import PSConfig
from geofed_hpc.errors import AuthError, LimitError, PermissionDeniedError
from geofed_hpc.log import quote
from geofed_hpc.ps.sessions import SessionTable, is_session_credential
from geofed_hpc.ps.slots import RETRY_AFTER
from geofed_hpc.ps.tokens import admits, token_hash
from geofed_hpc.rpc.guard import Caller, Principal

# Methods that hold a handler thread while data moves (or a long-poll waits): what the limits below count.
UPLOADS = ("PushDelta", "Split")
DOWNLOADS = ("StreamModel", "FetchAux")


class Gate:
    """Implements rpc.guard.Authority for one PS: every call proves who it is before it is given a thread.

    Credentials, per method: Join takes a site's enrollment token (ps.enroll_token or an issued one) or a one-time
    rejoin token (any, or none, on a PS that requires no token); Status takes the operator's admin token, a live
    session's credential or a valid enrollment token (anything on an open PS); every other method takes a live
    session's credential. Under mutual TLS a call's certificate must be its site's (`check_site`; `admit` checks it
    for every call of a session).

    What an admitted caller may hold at once, so that no caller can take what the others need:
    `ps.max_uploads_per_session` pushes and split uploads and `ps.max_downloads_per_session` downloads and long-polls
    per session, `ps.max_streams_per_peer` of them per peer host, and `ps.max_workers - ps.reserved_workers` in all:
    the reserved handler threads always serve Join, Heartbeat and Status.

    Lock: `_lock` guards the counts (held for a few dict operations, never while anything waits)."""

    def __init__(self, cfg: PSConfig, sessions: SessionTable, admin_token: str = "") -> None:
        self.cfg = cfg
        self.sessions = sessions
        self._admin = token_hash(admin_token) if admin_token else ""
        self.mutual_tls = bool(cfg.client_ca_file)
        self.max_streams = cfg.max_workers - cfg.reserved_workers
        self._lock = threading.Lock()
        self._per_session: Counter[tuple[str, str]] = Counter()
        self._per_peer: Counter[str] = Counter()
        self._streams = 0

    # ---------------------------------------------------------------- who
    def authenticate(self, method: str, credential: str) -> Principal:
        """Who `credential` proves the caller of `method` to be; AuthError otherwise (see the class)."""
        if method == "Join":
            return self._joining(credential)
        if method == "Status":
            return self._observing(credential)
        if not credential:
            raise AuthError(f"{method} needs the session's credential (from Join) in the call's metadata")
        principal = self.sessions.principal(credential)
        self._refuse_when_full(principal, method)  # answered before the call is dispatched: a flood costs less
        return principal

    def _joining(self, credential: str) -> Principal:
        verifier = self.sessions.verifier
        if not verifier.required:
            return Principal("open")
        if not credential:
            raise AuthError("Join needs a token: the site's enrollment token (site.token), or its rejoin token")
        rejoin = self.sessions.rejoin_principal(credential)
        if rejoin is not None:
            return rejoin
        if not verifier.known(credential):
            raise AuthError(
                "Join: enrollment token refused (unknown or wrong token; check site.token), or a rejoin token that is "
                "unknown or already used (enroll again with the site token)"
            )
        record = verifier.identify(credential, "Join")
        return Principal("enroll", record.site if record is not None else "")

    def _observing(self, credential: str) -> Principal:
        if self._admin and credential and hmac.compare_digest(self._admin, token_hash(credential)):
            return Principal("admin")
        if not self.sessions.verifier.required:
            return Principal("open")
        if not credential:
            raise AuthError(
                "Status needs a credential: the operator's admin token (on the PS's machine: <ps.state_dir>/"
                "admin.token), a site's enrollment token (site.token) or a session's"
            )
        if is_session_credential(credential):
            return self.sessions.principal(credential)
        record = self.sessions.verifier.identify(credential, "Status")
        return Principal("enroll", record.site if record is not None else "")

    def check_site(self, caller: Caller | None, site: str) -> None:
        """Under mutual TLS, PermissionDeniedError unless the caller's certificate was issued for `site` (or for the
        site it is a numbered job of: a certificate of osc admits osc-0, osc-1, ...)."""
        if caller is None or not self.mutual_tls:
            return  # in process, or no client certificates: nothing to bind
        if not caller.cert_names:
            raise PermissionDeniedError("mutual TLS: the call carries no client certificate")
        if not any(admits(name, site) for name in caller.cert_names):
            names = ", ".join(quote(n, 40) for n in caller.cert_names)
            raise PermissionDeniedError(f"the client certificate is for {names}, not for site {quote(site)}")

    # ---------------------------------------------------------------- how much
    def _share(self, method: str) -> tuple[str, int]:
        """What a call of `method` holds ("uploads", "downloads" or "": nothing) and how many a session may hold."""
        if method in UPLOADS:
            return "uploads", self.cfg.max_uploads_per_session
        if method in DOWNLOADS:
            return "downloads", self.cfg.max_downloads_per_session
        return "", 0

    def _refuse_when_full(self, principal: Principal, method: str) -> None:
        """LimitError when the session holds its share of `method`'s slots already (`admit` takes them)."""
        kind, per_session = self._share(method)
        if kind:
            with self._lock:
                full = self._per_session[(principal.session, kind)] >= per_session
            if full:
                raise self._session_full(kind, per_session)

    @staticmethod
    def _session_full(kind: str, per_session: int) -> LimitError:
        field = f"ps.max_{kind}_per_session"
        return LimitError(f"this session has {per_session} {kind} open ({field}); retry", RETRY_AFTER)

    def admit(self, caller: Caller) -> Callable[[], None]:
        """Bind the call to its certificate and take its slots; the release (idempotent) gives them back."""
        principal = caller.principal
        if principal.kind == "session":
            self.check_site(caller, principal.site)
        elif principal.kind == "admin" and self.mutual_tls and not caller.cert_names:
            raise PermissionDeniedError("mutual TLS: the call carries no client certificate")
        kind, per_session = self._share(caller.method)
        if not kind:
            return _nothing
        key = (principal.session, kind)
        with self._lock:
            if self._per_session[key] >= per_session:
                raise self._session_full(kind, per_session)
            if self._per_peer[caller.peer] >= self.cfg.max_streams_per_peer:
                field = f"ps.max_streams_per_peer={self.cfg.max_streams_per_peer}"
                raise LimitError(f"too many streams from {quote(caller.peer, 48)} ({field}); retry", RETRY_AFTER)
            if self._streams >= self.max_streams:
                raise LimitError(
                    f"the parameter server serves {self._streams} streams, its most (ps.max_workers - "
                    "ps.reserved_workers); retry",
                    RETRY_AFTER,
                )
            self._per_session[key] += 1
            self._per_peer[caller.peer] += 1
            self._streams += 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
                self._per_session[key] -= 1
                if self._per_session[key] <= 0:
                    del self._per_session[key]
                self._per_peer[caller.peer] -= 1
                if self._per_peer[caller.peer] <= 0:
                    del self._per_peer[caller.peer]
                self._streams -= 1

        return release

    @property
    def streams(self) -> int:
        """Streams held now (uploads and downloads of every session)."""
        with self._lock:
            return self._streams


def _nothing() -> None:
    """The release of a call that holds no slot."""
