"""The site's side of geofed.v1: dial out, call with retries, stream payloads in and out."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import grpc

from geofed_hpc.config import PSConfig
from geofed_hpc.errors import GeofedError, ProtocolError, UnavailableError, from_grpc_code
from geofed_hpc.faults import fault
from geofed_hpc.log import logger
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc import serde
from geofed_hpc.rpc.channel import channel_credentials, client_options
from geofed_hpc.rpc.guard import RETRY_PUSHBACK_KEY, bearer
from geofed_hpc.rpc.proxy import passing
from geofed_hpc.rpc.retry import MAX_WAIT, Backoff
from geofed_hpc.rpc.stream import collect, digest, to_chunks
from geofed_hpc.rpc.tls import diagnose

T = TypeVar("T")
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# What gRPC itself answers, before any handler, to a call beyond the server's maximum_concurrent_rpcs (rpc/server.py):
# a moment's overload (a storm of Joins, a thousand sites leaving at once), waited out with backoff like UNAVAILABLE.
GRPC_CONCURRENCY_REFUSAL = "Concurrent RPC limit exceeded"
# Join, Heartbeat, Status and Health are small and asked again soon: a short retry budget and deadline, so a
# site's training loop or an operator's `status` never sits through a long outage on them.
QUICK_BUDGET = timedelta(seconds=4)
QUICK_TIMEOUT = timedelta(seconds=15)
# A failed connect or Join probes the address once with the standard library to name a TLS mistake (tls.diagnose).
DIAGNOSE_TIMEOUT = timedelta(seconds=3)


class PSClient:
    """A connection to a parameter server; every call returns rpc.messages dataclasses. Given several addresses
    ("a:port,b:port", the peers of a PS group, nearest first) it dials the first, and moves to the next when the
    one it dials has not answered for ps.failover_after (a call then meets a PS that does not know the session:
    AuthError, and the site joins it)."""

    def __init__(self, cfg: PSConfig, address: str | None = None, options: Sequence[tuple[str, Any]] = ()) -> None:
        self.cfg = cfg
        self.options = list(options)  # before the usual ones: gRPC takes the first of a repeated option (egress/paths)
        self.addresses = (address or cfg.address or cfg.dial_address()).split(",")
        self._calls: dict[str, Any] = {}
        self.last_pull_wait_s = 0.0
        # asked before each retry: a site that is told to stop (Slurm's warning signal) stops retrying at once
        self.keep_retrying: Callable[[], bool] = lambda: True
        self._failing_since: float | None = None  # when the address dialled now stopped answering
        self._dial(0)

    def _dial(self, index: int) -> None:
        """Open a channel to addresses[index]."""
        cfg = self.cfg
        self._index = index
        self.address = self.addresses[index]
        if cfg.insecure:
            self._channel = grpc.insecure_channel(self.address, options=[*self.options, *client_options(cfg)])
        else:
            options = [*self.options, *client_options(cfg)]
            self._channel = grpc.secure_channel(self.address, channel_credentials(cfg), options=options)
        for meth in serde.METHODS:
            kind = (
                self._channel.stream_stream
                if meth.client_streaming and meth.server_streaming
                else self._channel.stream_unary
                if meth.client_streaming
                else self._channel.unary_stream
                if meth.server_streaming
                else self._channel.unary_unary
            )
            self._calls[meth.name] = kind(
                meth.path,
                request_serializer=serde.serializer(meth.request),
                response_deserializer=serde.deserializer(meth.reply),
            )

    def close(self) -> None:
        self._channel.close()

    def failover(self) -> bool:
        """Dial the next address (after the last, the first again); False when there is only one."""
        if len(self.addresses) < 2:
            return False
        gone = self.address
        self._channel.close()
        self._dial((self._index + 1) % len(self.addresses))
        self._failing_since = None
        logger.warning("parameter server %s does not answer: failing over to %s", gone, self.address)
        return True

    def _unanswered(self) -> None:
        """A call found the PS unreachable: fail over once it has been so for ps.failover_after."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        elif now - self._failing_since >= self.cfg.failover_after.total_seconds():
            self.failover()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self, timeout: timedelta | None = None) -> None:
        """Wait until the server answers, retrying with backoff, never past `timeout` (ps.connect_timeout); raise
        UnavailableError naming the address. Something that answers but not as configured (TLS against plaintext,
        a CA that does not verify it, a client certificate it refuses) is named at once: retrying cannot help.
        With several addresses each but the last is given ps.failover_after, in order, until one answers."""
        timeout = timeout or self.cfg.connect_timeout
        for _ in range(len(self.addresses) - 1):
            try:
                return self._connect(min(timeout, self.cfg.failover_after))
            except UnavailableError as exc:
                logger.warning("%s", exc)
                self.failover()
        return self._connect(timeout)

    def _connect(self, timeout: timedelta) -> None:
        ready = grpc.channel_ready_future(self._channel)  # one watch for all attempts, ended however this ends
        try:
            self._await(ready, timeout)
        finally:
            ready.cancel()  # a watch left running outlives the channel and dies with a traceback at exit

    def _await(self, ready: grpc.Future, timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        wait, attempt, why = 0.5, 0, None
        while True:
            attempt += 1
            left = deadline - time.monotonic()
            try:
                ready.result(timeout=max(0.0, min(wait * 4, 10.0, left)))
                return
            except grpc.FutureTimeoutError:
                pass
            if why is None:
                why = self._diagnosis(timedelta(seconds=min(DIAGNOSE_TIMEOUT.total_seconds(), max(left, 0.5))))
                if why and not why.startswith("TLS handshake with") and not passing(why):
                    raise UnavailableError(f"{why} (no more connection attempts: retrying cannot fix this)")
            if time.monotonic() >= deadline:
                raise UnavailableError(self._unreachable(timeout, attempt, why))
            logger.info("parameter server %s not answering yet (attempt %d); retrying", self.address, attempt)
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
            wait = min(wait * 2, 8.0)

    def _unreachable(self, timeout: timedelta, attempts: int, why: str) -> str:
        if why:
            return f"{why} ({attempts} attempts in {timeout.total_seconds():g}s)"
        return (
            f"cannot reach the parameter server at {self.address} after {timeout.total_seconds():g}s "
            f"({attempts} attempts): check that `geofed-hpc ps up` is running there, that the port is open "
            f"to this host (firewall, proxy), that ps.address is right, and that ps.insecure matches the server"
        )

    def _diagnosis(self, timeout: timedelta = DIAGNOSE_TIMEOUT) -> str:
        """Why the handshake fails when something answers at the address (TLS against plaintext, a CA or client
        certificate the PS does not take), in one line naming the setting; '' when nothing answers or all is fine."""
        why = diagnose(self.address, self.cfg, timeout)
        return "" if why.startswith("nothing answers") else why

    def _call(self, name: str, fn: Callable[[], T], budget: timedelta | None = None) -> T:
        """Call `fn`; while it fails with UNAVAILABLE or DEADLINE_EXCEEDED, retry with jittered exponential
        backoff until `budget` (ps.retry_budget by default) is spent, then raise UnavailableError. After a failover
        the next PS is tried at once, and its retries start from the first wait again (within the same budget)."""
        backoff = Backoff(self.cfg.retry_budget if budget is None else budget)
        while True:
            try:
                result = fn()
                self._failing_since = None
                return result
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAVAILABLE:
                    dialled = self.address
                    self._unanswered()
                    if self.address != dialled and self.keep_retrying():  # failed over: the next PS, at once
                        backoff.restart()
                        continue
                hint = _retry_hint(exc)  # a limit of the PS that says when to come back is waited out too
                retryable = code in _RETRYABLE or hint is not None or _overloaded(exc)
                wait = backoff.next_wait() if retryable and self.keep_retrying() else None
                if wait is not None and hint is not None:
                    wait = max(wait, min(hint, MAX_WAIT.total_seconds()))
                if wait is None:
                    error = self._error(name, exc)
                    if retryable and (backoff.attempts > 1 or hint is not None):  # a busy PS counts as unreachable
                        error = UnavailableError(f"{error} ({backoff.attempts} attempts in {backoff.elapsed:.0f}s)")
                    raise error from None
                logger.warning(
                    "%s to %s failed (%s); retry %d in %.1fs", name, self.address, code.name, backoff.attempts, wait
                )
                time.sleep(wait)

    def _error(self, name: str, exc: grpc.RpcError) -> GeofedError:
        code, details = exc.code(), exc.details() or ""
        if code in _RETRYABLE:
            return UnavailableError(f"{name} to the parameter server at {self.address} failed: {code.name} {details}")
        return from_grpc_code(code.name, f"{name} refused by the parameter server: {details}")

    def _timeout(self) -> float:
        return self.cfg.rpc_timeout.total_seconds()

    def join(self, request: m.JoinRequest) -> m.JoinReply:
        """Join (after `connect`, which waits for the PS): retried briefly, so a TLS or proxy mistake shows now."""
        try:
            join = self._calls["Join"]
            return self._call(
                "Join", lambda: join(request, timeout=self._timeout(), metadata=bearer(request.token)), QUICK_BUDGET
            )
        except UnavailableError as exc:
            why = self._diagnosis()
            if why:
                raise UnavailableError(f"{why} ({exc})") from None
            raise

    def _quick(self) -> float:
        return min(self._timeout(), QUICK_TIMEOUT.total_seconds())

    def heartbeat(
        self, request: m.HeartbeatRequest, budget: timedelta = QUICK_BUDGET, timeout: timedelta | None = None
    ) -> m.HeartbeatReply:
        seconds = timeout.total_seconds() if timeout else self._quick()  # the channel of the moment (failover)
        auth = bearer(request.session_id)
        return self._call(
            "Heartbeat", lambda: self._calls["Heartbeat"](request, timeout=seconds, metadata=auth), budget
        )

    def status(self, credential: str = "") -> m.StatusReply:
        """The federation as the PS shows it. `credential`: the operator's admin token, a site's enrollment token
        or a session's (a PS that requires tokens answers nobody else)."""
        auth = bearer(credential)
        return self._call(
            "Status",
            lambda: self._calls["Status"](m.StatusRequest(), timeout=self._quick(), metadata=auth),
            QUICK_BUDGET,
        )

    def health(self, service: str = serde.SERVICE) -> str:
        """The grpc.health.v1 status of `service` ("" for the whole server): SERVING, NOT_SERVING, ..."""
        return self._call("Health", lambda: serde.health_check(self._channel)(service, self._quick()), QUICK_BUDGET)

    def pull_model(
        self,
        session_id: str,
        min_version: int = 0,
        wait: timedelta = timedelta(0),
        have_version: int | None = None,
        budget: timedelta | None = None,
    ) -> tuple[m.ModelHeader, bytes]:
        """Stream the global model at a version >= min_version (waiting up to `wait` for it).

        With `have_version` the PS may answer with kind "updates": the encoded global updates since that
        version, concatenated (header.segments holds their lengths), instead of the whole model.
        """
        request = m.ModelRequest(
            session_id=session_id,
            min_version=min_version,
            wait_s=wait.total_seconds(),
            have_version=have_version if have_version is not None else 0,
            want_updates=have_version is not None,
        )
        timeout = self._timeout() + wait.total_seconds()

        def pull() -> tuple[m.ModelHeader, bytes]:
            started, first = time.monotonic(), list[float]()

            def timed(chunks: Iterator[m.Chunk]) -> Iterator[m.Chunk]:
                for chunk in chunks:
                    if not first:
                        first.append(time.monotonic())
                    yield chunk

            stream = timed(self._calls["StreamModel"](request, timeout=timeout, metadata=bearer(session_id)))
            header, payload = collect(stream, self.cfg.max_delta_bytes)
            self.last_pull_wait_s = (first[0] if first else time.monotonic()) - started
            assert isinstance(header, m.ModelHeader)
            return header, payload

        return self._call("StreamModel", pull, budget)

    def push_delta(self, header: m.PushHeader, payload: bytes, budget: timedelta | None = None) -> m.PushReply:
        """Stream one payload, retransmitting within `budget` (ps.retry_budget by default); every retry resends
        the same push_id, so a push the PS got but whose reply was lost is never applied twice."""
        header.total_bytes = len(payload)
        header.sha256 = digest(payload)
        header.push_id = header.push_id or uuid.uuid4().hex

        def push() -> m.PushReply:
            return self._calls["PushDelta"](
                sent(to_chunks(header, payload, self.cfg.chunk_bytes)),
                timeout=self._timeout(),
                metadata=bearer(header.session_id),
            )

        def sent(chunks: Iterator[m.Chunk]) -> Iterator[m.Chunk]:
            for i, chunk in enumerate(chunks):
                if i == 1:
                    fault("rpc.push", header.push_id)  # the header chunk is on its way, the rest is not
                yield chunk

        return self._call("PushDelta", push, budget)

    def split(
        self, header: m.SplitHeader, payload: bytes, budget: timedelta | None = None
    ) -> tuple[m.SplitHeader, bytes]:
        """Send cut-layer activations (and targets) to the server part; its answer: a header (loss, counts) and
        the encoded gradient for kind "gradient" (else no bytes). Retried within `budget` like a push."""
        header.total_bytes = len(payload)
        header.sha256 = digest(payload)

        def call() -> tuple[m.SplitHeader, bytes]:
            chunks = to_chunks(header, payload, self.cfg.chunk_bytes)
            stream = self._calls["Split"](chunks, timeout=self._timeout(), metadata=bearer(header.session_id))
            return _split_answer(collect(stream, self.cfg.max_delta_bytes))

        return self._call("Split", call, budget)

    def fetch_aux(self, request: m.AuxRequest, budget: timedelta | None = None) -> tuple[m.SplitHeader, bytes]:
        """The auxiliary model the server fitted at an alignment version: a header and its encoded tensors (no
        bytes: the server keeps no activations yet, nothing was fitted)."""

        def call() -> tuple[m.SplitHeader, bytes]:
            stream = self._calls["FetchAux"](request, timeout=self._timeout(), metadata=bearer(request.session_id))
            return _split_answer(collect(stream, self.cfg.max_delta_bytes))

        return self._call("FetchAux", call, budget)


def _split_answer(answer: tuple[Any, bytes]) -> tuple[m.SplitHeader, bytes]:
    header, payload = answer
    if not isinstance(header, m.SplitHeader):
        raise ProtocolError(f"the parameter server answered a split call with a {type(header).__name__}")
    return header, payload


def _overloaded(exc: grpc.RpcError) -> bool:
    """The server's gRPC refused the call for its number of calls in flight (no handler saw it, nothing was done)."""
    return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (exc.details() or "").startswith(
        GRPC_CONCURRENCY_REFUSAL
    )


def _retry_hint(exc: grpc.RpcError) -> float | None:
    """Seconds a RESOURCE_EXHAUSTED answer asks the caller to wait before trying again (None: no such hint)."""
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == RETRY_PUSHBACK_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None
