"""Serve any handler object over gRPC: method routing, error-to-status mapping, port binding."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import grpc

from geofed_hpc.config import PSConfig
from geofed_hpc.errors import GeofedError, UnavailableError
from geofed_hpc.log import logger
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc import serde
from geofed_hpc.rpc.channel import server_credentials, server_options


class Handler(Protocol):
    """What a parameter server implements; it sees only dataclasses from rpc.messages."""

    def join(self, request: m.JoinRequest) -> m.JoinReply: ...
    def stream_model(self, request: m.ModelRequest) -> Iterator[m.Chunk]: ...
    def push_delta(self, chunks: Iterator[m.Chunk]) -> m.PushReply: ...
    def heartbeat(self, request: m.HeartbeatRequest) -> m.HeartbeatReply: ...
    def status(self, request: m.StatusRequest) -> m.StatusReply: ...
    def split(self, chunks: Iterator[m.Chunk]) -> Iterator[m.Chunk]: ...
    def fetch_aux(self, request: m.AuxRequest) -> Iterator[m.Chunk]: ...


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


OnRpc = Callable[[str, str, float], None]
"""Called once per finished RPC with (method, status code name, seconds); it must not raise."""


# Status codes that mean the server crashed, never that the request was wrong: logged with the stack.
CRASH_CODES = ("INTERNAL", "UNKNOWN")


def _abort(context: grpc.ServicerContext, method: str, exc: BaseException) -> None:
    if isinstance(exc, GeofedError) and exc.grpc_code not in CRASH_CODES:
        logger.warning("%s refused: %s", method, exc)
        context.abort(getattr(grpc.StatusCode, exc.grpc_code), str(exc))
    if isinstance(exc, GeofedError):  # one of ours, but no refusal of the request: a fault of this server
        logger.error("%s failed: %s", method, exc, exc_info=exc)
        context.abort(getattr(grpc.StatusCode, exc.grpc_code), str(exc))
    logger.error("%s failed with an unexpected error", method, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")


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


def _unary(
    method: str, fn: Callable[[Any], Any], parse: Parse, on_rpc: OnRpc | None
) -> Callable[[bytes, grpc.ServicerContext], Any]:
    def call(raw: bytes, context: grpc.ServicerContext) -> Any:
        obs = _Observed(method, on_rpc)
        try:
            return fn(parse(raw))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status, never a crash
            obs.failed(exc)
            _abort(context, method, exc)
        finally:
            obs.done()

    return call


def _server_stream(
    method: str, fn: Callable[[Any], Iterator[Any]], parse: Parse, on_rpc: OnRpc | None
) -> Callable[..., Iterator[Any]]:
    def call(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
        obs = _Observed(method, on_rpc)
        try:
            yield from fn(parse(raw))
        except Exception as exc:  # noqa: BLE001
            obs.failed(exc)
            _abort(context, method, exc)
        except BaseException as exc:  # GeneratorExit: the client cancelled the stream
            obs.failed(exc)
            raise
        finally:
            obs.done()

    return call


def _client_stream(
    method: str, fn: Callable[[Iterator[Any]], Any], parse: Parse, on_rpc: OnRpc | None
) -> Callable[..., Any]:
    def call(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        obs = _Observed(method, on_rpc)
        try:
            return fn(parse(raw) for raw in request_iterator)
        except grpc.RpcError as exc:  # the client went away mid-stream
            obs.failed(exc)
            _abort(context, method, UnavailableError(f"stream broken by the client: {exc}"))
        except Exception as exc:  # noqa: BLE001
            obs.failed(exc)
            _abort(context, method, exc)
        finally:
            obs.done()

    return call


def _bidi_stream(
    method: str, fn: Callable[[Iterator[Any]], Iterator[Any]], parse: Parse, on_rpc: OnRpc | None
) -> Callable[..., Iterator[Any]]:
    def call(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
        obs = _Observed(method, on_rpc)
        try:
            yield from fn(parse(raw) for raw in request_iterator)
        except grpc.RpcError as exc:  # the client went away mid-stream
            obs.failed(exc)
            _abort(context, method, UnavailableError(f"stream broken by the client: {exc}"))
        except Exception as exc:  # noqa: BLE001
            obs.failed(exc)
            _abort(context, method, exc)
        except BaseException as exc:  # GeneratorExit: the client cancelled the stream
            obs.failed(exc)
            raise
        finally:
            obs.done()

    return call


def generic_handler(handler: Handler, on_rpc: OnRpc | None = None) -> grpc.GenericRpcHandler:
    """Route every geofed.v1 method to `handler`, (de)serialising through rpc.serde; `on_rpc` sees each call.

    Requests arrive as bytes and are parsed inside the handler: bytes that do not parse are bad input
    (INVALID_ARGUMENT, naming the message), so INTERNAL (or UNKNOWN) always means a crash, logged with its stack."""
    table = {}
    for meth in serde.METHODS:
        fn = getattr(handler, snake(meth.name))
        parse, ser = serde.deserializer(meth.request), serde.serializer(meth.reply)
        if meth.client_streaming and meth.server_streaming:
            call = _bidi_stream(meth.name, fn, parse, on_rpc)
            table[meth.name] = grpc.stream_stream_rpc_method_handler(call, None, ser)
        elif meth.client_streaming:
            call = _client_stream(meth.name, fn, parse, on_rpc)
            table[meth.name] = grpc.stream_unary_rpc_method_handler(call, None, ser)
        elif meth.server_streaming:
            call = _server_stream(meth.name, fn, parse, on_rpc)
            table[meth.name] = grpc.unary_stream_rpc_method_handler(call, None, ser)
        else:
            table[meth.name] = grpc.unary_unary_rpc_method_handler(_unary(meth.name, fn, parse, on_rpc), None, ser)
    return grpc.method_handlers_generic_handler(serde.SERVICE, table)


@dataclass
class RunningServer:
    """A started gRPC server, its bound port and its grpc.health.v1 service."""

    server: grpc.Server
    port: int
    health: Any

    def drain(self, grace: timedelta) -> None:
        """Report NOT_SERVING, refuse new RPCs, let the ones in flight finish within `grace`, then stop."""
        serde.set_health(self.health, serving=False)
        self.server.stop(grace.total_seconds()).wait()


def start_server(handler: Handler, cfg: PSConfig, on_rpc: OnRpc | None = None) -> RunningServer:
    """Bind host:port (0 picks a free port), start serving geofed.v1 and grpc.health.v1 (SERVING); `on_rpc`
    (optional) is told the method, status code and seconds of every geofed.v1 call."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.max_workers), options=server_options(cfg))
    server.add_generic_rpc_handlers((generic_handler(handler, on_rpc),))
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
    serde.set_health(health, serving=True)
    logger.info("parameter server listening on %s:%d (%s)", cfg.host, port, "plaintext" if cfg.insecure else "TLS")
    return RunningServer(server, port, health)
