"""The only module that touches generated protobuf classes: dataclass <-> wire bytes."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from geofed_hpc.errors import ProtocolError
from geofed_hpc.rpc import geofed_pb2 as pb
from geofed_hpc.rpc import messages as m

SERVICE = "geofed.v1.ParameterServer"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def to_proto(obj: Any) -> Any:
    """Build the protobuf message named like dataclass `obj`."""
    msg = getattr(pb, type(obj).__name__)()
    _fill(msg, obj)
    return msg


def _fill(msg: Any, obj: Any) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        if dataclasses.is_dataclass(value):
            _fill(getattr(msg, f.name), value)
        elif isinstance(value, list):
            target = getattr(msg, f.name)
            for item in value:
                if dataclasses.is_dataclass(item):
                    _fill(target.add(), item)
                else:
                    target.append(item)
        else:
            setattr(msg, f.name, value)


def from_proto(cls: type, msg: Any) -> Any:
    """Build dataclass `cls` from protobuf message `msg` (unset sub-messages become None)."""
    kwargs: dict[str, Any] = {}
    for name, kind, inner in _fields(cls):
        value = getattr(msg, name)
        if kind == "messages":
            kwargs[name] = [from_proto(inner, item) for item in value]
        elif kind == "message":
            kwargs[name] = from_proto(inner, value) if msg.HasField(name) else None
        elif kind == "list":
            kwargs[name] = list(value)
        else:
            kwargs[name] = value
    return cls(**kwargs)


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, str, Any], ...]:
    """(field, kind, dataclass inside) per field of `cls`, worked out once per class: resolving the annotations
    evaluates their strings, too slow to repeat for every chunk of a push."""
    hints = typing.get_type_hints(cls, vars(m))
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        inner = _dataclass_in(hint)
        listed = typing.get_origin(hint) is list
        kind = ("messages" if listed else "message") if inner is not None else ("list" if listed else "value")
        out.append((f.name, kind, inner))
    return tuple(out)


def _dataclass_in(hint: Any) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint  # type: ignore[return-value]
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]
    return None


# What a request may hold, checked as it is parsed (a request over a limit is INVALID_ARGUMENT naming the field and
# the limit, and is never echoed): the characters of each string field, and the items of each repeated field.
STRING_LIMITS = {
    "site": 64,
    "token": 512,
    "resume_session": 128,
    "session_id": 128,
    "push_id": 128,
    "paradigm": 512,
    "client_version": 64,
    "codec": 32,
    "kind": 32,
}
DEFAULT_STRING_LIMIT = 256
LIST_LIMITS = {"shape": 8}
DEFAULT_LIST_LIMIT = 4096


def check_bounds(obj: Any) -> None:
    """ProtocolError naming the first field of `obj` (a parsed message, nested ones included) over its limit."""
    for name, kind, _inner in _fields(type(obj)):  # type: ignore[arg-type]
        value = getattr(obj, name)
        where = f"{type(obj).__name__}.{name}"
        if isinstance(value, str) and len(value) > (limit := STRING_LIMITS.get(name, DEFAULT_STRING_LIMIT)):
            raise ProtocolError(f"{where}: {len(value)} characters, over its limit of {limit}")
        if kind in ("list", "messages") and len(value) > (limit := LIST_LIMITS.get(name, DEFAULT_LIST_LIMIT)):
            raise ProtocolError(f"{where}: {len(value)} items, over its limit of {limit}")
        if kind == "message" and value is not None:
            check_bounds(value)
        if kind == "messages":
            for item in value:
                check_bounds(item)


def serializer(_cls: type) -> Callable[[Any], bytes]:
    return lambda obj: to_proto(obj).SerializeToString()


def deserializer(cls: type, bounded: bool = False) -> Callable[[bytes], Any]:
    """Wire bytes to dataclass `cls`; ProtocolError for bytes that do not parse and, with `bounded` (what a server
    receives), for a field over its limit (check_bounds)."""
    pb_cls = getattr(pb, cls.__name__)

    def parse(data: bytes) -> Any:
        msg = pb_cls()
        try:
            msg.ParseFromString(data)
        except DecodeError as exc:
            raise ProtocolError(f"malformed {cls.__name__} message: {exc}") from exc
        obj = from_proto(cls, msg)
        if bounded:
            check_bounds(obj)
        return obj

    return parse


@dataclass(frozen=True)
class Method:
    """One RPC: its name, shape and the dataclasses it carries."""

    name: str
    request: type
    reply: type
    client_streaming: bool = False
    server_streaming: bool = False

    @property
    def path(self) -> str:
        return f"/{SERVICE}/{self.name}"


METHODS: tuple[Method, ...] = (
    Method("Join", m.JoinRequest, m.JoinReply),
    Method("StreamModel", m.ModelRequest, m.Chunk, server_streaming=True),
    Method("PushDelta", m.Chunk, m.PushReply, client_streaming=True),
    Method("Heartbeat", m.HeartbeatRequest, m.HeartbeatReply),
    Method("Status", m.StatusRequest, m.StatusReply),
    Method("Split", m.Chunk, m.Chunk, client_streaming=True, server_streaming=True),
    Method("FetchAux", m.AuxRequest, m.Chunk, server_streaming=True),
)


def service_descriptor_methods() -> list[str]:
    """Method names as the generated descriptor declares them (a test compares with METHODS)."""
    return [meth.name for meth in pb.DESCRIPTOR.services_by_name["ParameterServer"].methods]


# The standard gRPC health service (grpc.health.v1): its generated messages are touched here only.


def health_servicer() -> Any:
    """A grpc.health.v1 servicer reporting both the whole server ("") and geofed.v1 as NOT_SERVING."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    set_health(servicer, serving=False)
    return servicer


def add_health(server: Any, servicer: Any) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)


def set_health(servicer: Any, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE):
        servicer.set(name, status)


def health_check(channel: Any) -> Callable[[str, float], str]:
    """A callable (service, timeout_s) -> status name ("SERVING", "NOT_SERVING", ...) over `channel`."""
    call = channel.unary_unary(
        HEALTH_CHECK,
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )

    def check(service: str, timeout: float) -> str:
        reply = call(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    return check
