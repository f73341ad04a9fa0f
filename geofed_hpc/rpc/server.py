"""Serve a handler over gRPC behind a gate that authenticates each call before it takes a thread: routing, errors."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import grpc

from geofed_hpc.config import PSConfig
from geofed_hpc.errors import GeofedError, UnavailableError
from geofed_hpc.log import escape, logger
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc import serde
from geofed_hpc.rpc.channel import server_credentials, server_options
from geofed_hpc.rpc.guard import (
    RETRY_PUSHBACK_KEY,
    Authority,
    Caller,
    Principal,
    Progress,
    Throttled,
    Watchdog,
    cert_names,
    credential_in,
    peer_host,
)

# Calls the server takes in at once, per handler thread (running or queued); beyond it gRPC answers
# RESOURCE_EXHAUSTED itself, on its polling thread, so a flood of calls cannot queue without end.
MAX_RPCS_PER_WORKER = 4


class Handler(Protocol):
    """What a parameter server implements; it sees only dataclasses from rpc.messages, and who calls (`caller`)."""

    def join(self, request: m.JoinRequest, caller: Caller | None = None) -> m.JoinReply: ...
    def stream_model(self, request: m.ModelRequest, caller: Caller | None = None) -> Iterator[m.Chunk]: ...
    def push_delta(self, chunks: Iterator[m.Chunk], caller: Caller | None = None) -> m.PushReply: ...
    def heartbeat(self, request: m.HeartbeatRequest, caller: Caller | None = None) -> m.HeartbeatReply: ...
    def status(self, request: m.StatusRequest, caller: Caller | None = None) -> m.StatusReply: ...
    def split(self, chunks: Iterator[m.Chunk], caller: Caller | None = None) -> Iterator[m.Chunk]: ...
    def fetch_aux(self, request: m.AuxRequest, caller: Caller | None = None) -> Iterator[m.Chunk]: ...


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


OnRpc = Callable[[str, str, float], None]
"""Called once per finished RPC with (method, status code name, seconds); it must not raise."""


# The longest status details the server sends (and logs for a refusal).
MAX_DETAILS = 1000
# Status codes that mean the server crashed, never that the request was wrong: logged with the stack.
CRASH_CODES = ("INTERNAL", "UNKNOWN")
_REFUSALS = Throttled()  # refused calls are logged, a line per method and kind every few seconds at most


def _status(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and details a failure answers with (escaped and cut: they may quote what the caller sent)."""
    if isinstance(exc, GeofedError):
        return getattr(grpc.StatusCode, exc.grpc_code), escape(exc, MAX_DETAILS)
    return grpc.StatusCode.INTERNAL, escape(f"internal error in {method}: {type(exc).__name__}: {exc}", MAX_DETAILS)


def _pushback(context: grpc.ServicerContext, exc: BaseException) -> None:
    """A limit that says when to come back: the trailer gRPC itself reads as a retry hint."""
    retry_after = getattr(exc, "retry_after", None)
    if isinstance(retry_after, timedelta):
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(int(retry_after.total_seconds() * 1000))),))


def _abort(context: grpc.ServicerContext, method: str, exc: BaseException) -> None:
    code, details = _status(exc, method)
    if isinstance(exc, GeofedError) and exc.grpc_code not in CRASH_CODES:
        _REFUSALS.warning(f"{method}:{exc.grpc_code}", "%s refused: %s", method, details)
        _pushback(context, exc)
    elif isinstance(exc, GeofedError):  # one of ours, but no refusal of the request: a fault of this server
        logger.error("%s failed: %s", method, exc, exc_info=exc)
    else:
        logger.error("%s failed with an unexpected error", method, exc_info=exc)
    context.abort(code, details)


def _code(exc: BaseException) -> str:
    if isinstance(exc, GeofedError):
        return str(exc.grpc_code)
    if isinstance(exc, grpc.RpcError):
        return "UNAVAILABLE"
    return "INTERNAL" if isinstance(exc, Exception) else "CANCELLED"


class _Observed:
    """Time one RPC and report (method, code, seconds) to `on_rpc` when it ends, however it ends."""

    def __init__(self, method: str, on_rpc: OnRpc | None) -> None:
        self.method, self.on_rpc, self.code = method, on_rpc, "OK"
        self.t0 = time.perf_counter()

    def failed(self, exc: BaseException) -> None:
        self.code = _code(exc)

    def done(self) -> None:
        if self.on_rpc is None:
            return
        try:
            self.on_rpc(self.method, self.code, time.perf_counter() - self.t0)
        except Exception:  # noqa: BLE001 - an observer never fails an RPC
            logger.debug("RPC observer failed for %s", self.method, exc_info=True)


Parse = Callable[[bytes], Any]
"""Request bytes to a dataclass (rpc.serde.deserializer): ProtocolError for bytes that do not parse."""
Answer = Callable[[Caller, Progress | None], Any]
"""What a call does once admitted, given its Caller and its progress record (streams the watchdog watches)."""
_END = object()


class _Route:
    """One geofed.v1 method behind the gate: its handler function, how its messages (de)serialise, and the handler
    gRPC runs for one call, made per call once the call's credential proved who calls."""

    def __init__(
        self,
        meth: serde.Method,
        fn: Callable[..., Any],
        authority: Authority,
        watchdog: Watchdog | None,
        on_rpc: OnRpc | None,
    ) -> None:
        self.meth, self.name, self.fn = meth, meth.name, fn
        self.parse: Parse = serde.deserializer(meth.request, bounded=True)
        self.serialize = serde.serializer(meth.reply)
        self.authority, self.on_rpc = authority, on_rpc
        self.watchdog = watchdog if (meth.client_streaming or meth.server_streaming) else None

    @contextmanager
    def admitted(
        self, context: grpc.ServicerContext, principal: Principal, credential: str
    ) -> Iterator[tuple[Caller, Progress | None]]:
        """The call's Caller, holding what the authority admits it to (released when the call ends, also when it is
        cancelled), and its progress record when it is a stream the watchdog watches."""
        caller = Caller(self.name, principal, credential, peer_host(context.peer()), cert_names(context.auth_context()))
        context.add_callback(caller.end)  # gRPC calls it when the call ends, a cancelled one at once
        release = self.authority.admit(caller)
        caller.on_end(release)
        progress = self.watchdog.watch(context, self.name) if self.watchdog is not None else None
        try:
            yield caller, progress
        finally:
            if progress is not None and self.watchdog is not None:
                self.watchdog.forget(progress)
            caller.end()

    def refusal(self, exc: BaseException) -> grpc.RpcMethodHandler:
        """A handler that answers at once with `exc`'s status, reading nothing of the request."""
        code, details = _status(exc, self.name)
        kind = exc.grpc_code if isinstance(exc, GeofedError) else "INTERNAL"
        _REFUSALS.warning(f"{self.name}:{kind}:gate", "%s refused before it started: %s", self.name, details)

        def refuse(_requests: Iterator[bytes], context: grpc.ServicerContext) -> None:
            obs = _Observed(self.name, self.on_rpc)
            obs.code = code.name
            obs.done()
            _pushback(context, exc)
            context.abort(code, details)

        return grpc.stream_unary_rpc_method_handler(refuse, None, self.serialize)  # dispatched unread

    def handler(self, principal: Principal, credential: str) -> grpc.RpcMethodHandler:
        meth = self.meth
        if meth.client_streaming and meth.server_streaming:
            return grpc.stream_stream_rpc_method_handler(self._bidi(principal, credential), None, self.serialize)
        if meth.client_streaming:
            return grpc.stream_unary_rpc_method_handler(self._client(principal, credential), None, self.serialize)
        if meth.server_streaming:
            return grpc.unary_stream_rpc_method_handler(self._server(principal, credential), None, self.serialize)
        return grpc.unary_unary_rpc_method_handler(self._unary(principal, credential), None, self.serialize)

    def _requests(self, raw: Iterator[bytes], progress: Progress | None) -> Iterator[Any]:
        """The request messages, parsed as they come; the watchdog sees the waits for each."""
        while True:
            if progress is not None:
                progress.waiting()
            item = next(raw, _END)
            if progress is not None:
                progress.moved(len(item) if isinstance(item, bytes) else 0)
            if item is _END:
                return
            yield self.parse(item)  # type: ignore[arg-type]

    @staticmethod
    def _responses(items: Iterator[Any], progress: Progress | None) -> Iterator[Any]:
        """The response messages; the time gRPC takes to hand each to the caller counts as waiting on it."""
        for item in items:
            if progress is not None:
                progress.waiting()
            yield item
            if progress is not None:
                progress.moved(len(getattr(item, "data", b"")))

    def _unary(self, principal: Principal, credential: str) -> Callable[[bytes, grpc.ServicerContext], Any]:
        def call(raw: bytes, context: grpc.ServicerContext) -> Any:
            return self._answer(context, principal, credential, lambda c, _: self.fn(self.parse(raw), c))

        return call

    def _client(self, principal: Principal, credential: str) -> Callable[..., Any]:
        def call(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            return self._answer(context, principal, credential, lambda c, p: self.fn(self._requests(requests, p), c))

        return call

    def _server(self, principal: Principal, credential: str) -> Callable[..., Iterator[Any]]:
        def call(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
            return self._stream(context, principal, credential, lambda c, _: self.fn(self.parse(raw), c))

        return call

    def _bidi(self, principal: Principal, credential: str) -> Callable[..., Iterator[Any]]:
        def call(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
            return self._stream(context, principal, credential, lambda c, p: self.fn(self._requests(requests, p), c))

        return call

    def _answer(self, context: grpc.ServicerContext, principal: Principal, credential: str, answer: Answer) -> Any:
        """One reply: `answer(caller, progress)` run for the admitted call; every failure becomes a status."""
        obs = _Observed(self.name, self.on_rpc)
        try:
            with self.admitted(context, principal, credential) as (caller, progress):
                return answer(caller, progress)
        except grpc.RpcError as exc:  # the client went away mid-stream (or the watchdog ended the call)
            obs.failed(exc)
            _abort(context, self.name, _broken(exc))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status, never a crash
            obs.failed(exc)
            _abort(context, self.name, exc)
        finally:
            obs.done()

    def _stream(
        self, context: grpc.ServicerContext, principal: Principal, credential: str, answer: Answer
    ) -> Iterator[Any]:
        """A stream of replies: those of `answer(caller, progress)` for the admitted call, as `_answer` does."""
        obs = _Observed(self.name, self.on_rpc)
        try:
            with self.admitted(context, principal, credential) as (caller, progress):
                yield from self._responses(answer(caller, progress), progress)
        except grpc.RpcError as exc:  # the client went away mid-stream
            obs.failed(exc)
            _abort(context, self.name, _broken(exc))
        except Exception as exc:  # noqa: BLE001
            obs.failed(exc)
            _abort(context, self.name, exc)
        except BaseException as exc:  # GeneratorExit: the client cancelled the stream
            obs.failed(exc)
            raise
        finally:
            obs.done()


class _Gate(grpc.GenericRpcHandler):
    """Every geofed.v1 call starts here, on gRPC's polling thread, before it has a handler thread: its credential is
    read from its metadata and checked by the authority; a call it does not prove is answered at once (nothing of
    its request read, no thread kept), the others get a handler made for their caller."""

    def __init__(self, routes: dict[str, _Route], authority: Authority) -> None:
        self.routes, self.authority = routes, authority

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        route = self.routes.get(handler_call_details.method)  # type: ignore[attr-defined]
        if route is None:
            return None  # another service (grpc.health.v1), or UNIMPLEMENTED
        try:
            credential = credential_in(handler_call_details.invocation_metadata)  # type: ignore[attr-defined]
            principal = self.authority.authenticate(route.name, credential)
        except Exception as exc:  # noqa: BLE001 - a refusal (or a fault of the check) is answered, never raised here
            if not isinstance(exc, GeofedError):
                logger.error("authenticating a %s call failed", route.name, exc_info=exc)
            return route.refusal(exc)
        return route.handler(principal, credential)


def generic_handler(
    handler: Handler, authority: Authority, watchdog: Watchdog | None = None, on_rpc: OnRpc | None = None
) -> grpc.GenericRpcHandler:
    """Route every geofed.v1 method to `handler` behind the gate of `authority`, (de)serialising through rpc.serde;
    `watchdog` ends stalled streams; `on_rpc` sees each call.

    Requests arrive as bytes and are parsed inside the handler: bytes that do not parse, or strings over their
    limits, are bad input (INVALID_ARGUMENT, naming the message or field), so INTERNAL (or UNKNOWN) always means a
    crash, logged with its stack."""
    routes = {
        meth.path: _Route(meth, getattr(handler, snake(meth.name)), authority, watchdog, on_rpc)
        for meth in serde.METHODS
    }
    return _Gate(routes, authority)


@dataclass
class RunningServer:
    """A started gRPC server, its bound port and its grpc.health.v1 service."""

    server: grpc.Server
    port: int
    health: Any
    watchdog: Watchdog

    def drain(self, grace: timedelta) -> None:
        """Report NOT_SERVING, refuse new RPCs, let the ones in flight finish within `grace`, then stop."""
        serde.set_health(self.health, serving=False)
        self.server.stop(grace.total_seconds()).wait()
        self.watchdog.stop()


def start_server(handler: Handler, authority: Authority, cfg: PSConfig, on_rpc: OnRpc | None = None) -> RunningServer:
    """Bind host:port (0 picks a free port), start serving geofed.v1 behind `authority`'s gate and grpc.health.v1
    (SERVING); `on_rpc` (optional) is told the method, status code and seconds of every geofed.v1 call."""
    pool = futures.ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="ps-rpc")
    server = grpc.server(
        pool, options=server_options(cfg), maximum_concurrent_rpcs=MAX_RPCS_PER_WORKER * cfg.max_workers
    )
    watchdog = Watchdog(cfg.stream_idle_timeout, cfg.stream_min_rate, 2 * cfg.rpc_timeout)
    server.add_generic_rpc_handlers((generic_handler(handler, authority, watchdog, on_rpc),))
    health = serde.health_servicer()
    serde.add_health(server, health)
    where = f"{cfg.host}:{cfg.port}"
    try:
        if cfg.insecure:
            port = server.add_insecure_port(where)
        else:
            port = server.add_secure_port(where, server_credentials(cfg))
    except RuntimeError as exc:
        port = 0
        logger.debug("bind %s failed: %s", where, exc)
    if port == 0:
        raise UnavailableError(
            f"cannot listen on {where}: the port is in use or the address is not local; "
            "stop the other process or choose another port with ps.port=..."
        )
    server.start()
    watchdog.start()
    serde.set_health(health, serving=True)
    logger.info("parameter server listening on %s:%d (%s)", cfg.host, port, "plaintext" if cfg.insecure else "TLS")
    return RunningServer(server, port, health, watchdog)


def _broken(exc: grpc.RpcError) -> UnavailableError:
    """A request stream that failed under the handler: the client cancelled, or the connection dropped (gRPC's own
    error then says nothing)."""
    said = str(exc).strip()
    return UnavailableError(f"stream broken by the client: {said or 'cancelled, or the connection dropped mid-stream'}")
