"""The server's edge: the credential a call carries in its metadata, who it proves the caller to be, stalled streams."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import grpc

from geofed_hpc.errors import AuthError, ConfigError
from geofed_hpc.log import logger, quote

METADATA_KEY = "authorization"
SCHEME = "Bearer "
MAX_CREDENTIAL_CHARS = 512
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's own trailer for "retry after this many ms"


def bearer(credential: str) -> tuple[tuple[str, str], ...]:
    """The metadata that carries `credential` on a call (none for an empty one); ConfigError for one a gRPC header
    cannot carry (printable ASCII only)."""
    if not credential:
        return ()
    if not (credential.isascii() and credential.isprintable()):
        raise ConfigError(
            f"the credential {quote(credential, 12)} holds characters a gRPC header cannot carry (printable ASCII "
            "only): check site.token"
        )
    return ((METADATA_KEY, SCHEME + credential),)


def credential_in(metadata: Sequence[tuple[str, Any]] | None) -> str:
    """The credential a call's metadata carries ("" for none); AuthError for a malformed or oversized one."""
    values = [v for k, v in (metadata or ()) if k == METADATA_KEY]
    if not values:
        return ""
    if len(values) > 1:
        raise AuthError(f"{len(values)} {METADATA_KEY} entries: send one")
    value = values[0] if isinstance(values[0], str) else ""
    if len(value) > MAX_CREDENTIAL_CHARS + len(SCHEME):
        raise AuthError(f"credential of {len(value)} characters refused (at most {MAX_CREDENTIAL_CHARS})")
    if not value.startswith(SCHEME):
        raise AuthError(f"{METADATA_KEY} metadata must read 'Bearer <credential>', not {quote(value, 12)}")
    return value[len(SCHEME) :]


@dataclass(frozen=True)
class Principal:
    """Who a call's credential proves the caller to be.

    kind: "open" (a PS that needs no token), "enroll" (a site's enrollment token), "rejoin" (a session's one-time
    rejoin token), "session" (a live session's credential) or "admin" (the operator's token)."""

    kind: str
    site: str = ""  # the site (or site family, for an enrollment token) the credential is for; "": any
    session: str = ""  # the session's public handle (kinds "session" and "rejoin")


class Caller:
    """One call as the server sees it: who (`principal`, `credential`), from where (`peer`: the host, `cert_names`:
    the common names of its mutual-TLS certificate) and whether it ended. Hooks given to `on_end` run once when the
    call ends, however it ends (a cancelled call: on gRPC's polling thread, so they must never block)."""

    def __init__(
        self,
        method: str,
        principal: Principal,
        credential: str = "",
        peer: str = "",
        cert_names: tuple[str, ...] = (),
    ) -> None:
        self.method, self.principal, self.credential = method, principal, credential
        self.peer, self.cert_names = peer, cert_names
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []
        self.ended = False

    def on_end(self, hook: Callable[[], None]) -> None:
        """Run `hook` when the call ends (at once when it has)."""
        with self._lock:
            if not self.ended:
                self._hooks.append(hook)
                return
        hook()

    def end(self) -> None:
        """The call is over (answered, failed or cancelled); idempotent."""
        with self._lock:
            if self.ended:
                return
            self.ended = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - a hook never fails the server
                logger.exception("a call's end hook failed")


class Authority(Protocol):
    """What the server asks the parameter server about each call (ps/gate.py)."""

    def authenticate(self, method: str, credential: str) -> Principal:
        """Who `credential` proves the caller of `method` to be; AuthError otherwise. Called on gRPC's polling thread
        before the call has a handler thread: it must be quick and must never block on I/O or a busy lock."""
        ...

    def admit(self, caller: Caller) -> Callable[[], None]:
        """Take what the call may hold (its slots), or raise (LimitError, PermissionDeniedError); returns the release,
        which may be called more than once."""
        ...


def peer_host(peer: str) -> str:
    """The host of gRPC's peer string ("ipv4:1.2.3.4:5678" -> "1.2.3.4", "ipv6:[::1]:5678" -> "::1")."""
    _, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]")


def cert_names(auth: Mapping[str, Sequence[bytes]]) -> tuple[str, ...]:
    """The common names of a mutual-TLS peer's certificate (none without one)."""
    return tuple(v.decode(errors="replace") for v in auth.get("x509_common_name", ()))


def cancel_call(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a call from outside its handler thread, telling the client `code` and `details` (gRPC's public
    `context.cancel()` can only say CANCELLED; its core call can say more, and is used when it is there)."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        call.cancel(code.value[0], details)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - another gRPC build: the public form
        context.cancel()


class Progress:
    """One long call's traffic as the watchdog sees it: whether the server waits on the caller now (for its next
    request message, or for it to take the last response), how long it has in all, and the bytes that moved."""

    def __init__(self, context: grpc.ServicerContext, method: str) -> None:
        self.context, self.method = context, method
        self.started = time.monotonic()
        self.waiting_since: float | None = None
        self.first = False  # the first message moved: the rate floor counts from here
        self.waited = 0.0  # seconds spent waiting on the caller since the first message
        self.bytes = 0  # bytes moved since the first message
        self.cancelled = ""

    def waiting(self) -> None:
        self.waiting_since = time.monotonic()

    def moved(self, nbytes: int) -> None:
        since, self.waiting_since = self.waiting_since, None
        if self.first and since is not None:
            self.waited += time.monotonic() - since
            self.bytes += nbytes
        self.first = True

    def verdict(self, now: float, idle: float, min_rate: float, max_age: float) -> str:
        """Why the call should be ended now ("": it should not)."""
        if now - self.started > max_age:
            return f"it ran for more than {max_age:g}s (twice ps.rpc_timeout)"
        since = self.waiting_since
        if since is None:
            return ""
        if now - since > idle:
            return f"no data moved for {idle:g}s (ps.stream_idle_timeout)"
        waited = self.waited + (now - since if self.first else 0.0)
        if self.first and waited > idle and self.bytes / waited < min_rate:
            rate = self.bytes / waited
            return f"it moved {rate:.0f} B/s, below ps.stream_min_rate ({min_rate:.0f} B/s)"
        return ""


class Watchdog:
    """Ends long calls whose caller stalls them: no data for `idle`, less than `min_rate` bytes/s on average once it
    waited `idle` on the caller in all, or older than `max_age`. One thread scans the calls every `tick`; the
    caller hears DEADLINE_EXCEEDED with the reason, and the handler's slots are released as its thread unwinds.

    Lock: `_lock` guards the set of calls watched; a Progress is written by its call's thread, read here."""

    def __init__(
        self, idle: timedelta, min_rate: int, max_age: timedelta, tick: timedelta = timedelta(milliseconds=250)
    ) -> None:
        self.idle, self.min_rate, self.max_age = idle.total_seconds(), float(min_rate), max_age.total_seconds()
        self.tick = tick.total_seconds()
        self._lock = threading.Lock()
        self._calls: set[Progress] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ps-watchdog", daemon=True)
        self.ended = 0  # calls it ended

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def watch(self, context: grpc.ServicerContext, method: str) -> Progress:
        progress = Progress(context, method)
        with self._lock:
            self._calls.add(progress)
        return progress

    def forget(self, progress: Progress) -> None:
        with self._lock:
            self._calls.discard(progress)

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            with self._lock:
                calls = list(self._calls)
            for p in calls:
                why = "" if p.cancelled else p.verdict(now, self.idle, self.min_rate, self.max_age)
                if why:
                    p.cancelled = why
                    self.ended += 1
                    logger.warning("%s from %s ended: %s", p.method, quote(p.context.peer(), 48), why)
                    cancel_call(p.context, grpc.StatusCode.DEADLINE_EXCEEDED, f"{p.method} ended by the server: {why}")


class Throttled:
    """Log one line per `key` at most every `every`, saying how many were left out meanwhile (a flood of refused
    calls must not flood the log)."""

    def __init__(self, every: timedelta = timedelta(seconds=10)) -> None:
        self.every = every.total_seconds()
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last, skipped = self._last.get(key, (-1e18, 0))
            if now - last < self.every:
                self._last[key] = (last, skipped + 1)
                return
            if len(self._last) > 1024:  # keys are few (method and reason), but never let them grow without end
                self._last.clear()
            self._last[key] = (now, 0)
        suffix = f" ({skipped} more like it in the last {now - last:.0f}s)" if skipped else ""
        logger.warning(msg + suffix, *args)
