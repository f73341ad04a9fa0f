"""The one error family of geofed-hpc; each error carries the gRPC status name it maps to."""

from __future__ import annotations

from datetime import timedelta


class GeofedError(Exception):
    """Base of every error geofed-hpc raises on purpose; its message is meant for the user."""

    grpc_code = "INTERNAL"


class ConfigError(GeofedError):
    """A configuration value, key or group option is wrong; the message names it."""

    grpc_code = "INVALID_ARGUMENT"


class ProtocolError(GeofedError):
    """A peer sent something the protocol does not allow (bad header, name, shape, version)."""

    grpc_code = "INVALID_ARGUMENT"


class CodecError(GeofedError):
    """Encoded bytes are malformed, truncated or fail their checksum."""

    grpc_code = "DATA_LOSS"


class CheckpointError(GeofedError):
    """A checkpoint or snapshot file is missing, truncated or corrupt."""


class StoreError(GeofedError, OSError):
    """An object store (or the folder standing in for one) refused or failed a request; the message names the
    object's URL and what to do. An OSError too: what survives a full disk survives a store that refuses writes.
    `missing`: the object is not there."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class AuthError(GeofedError):
    """A token or session is unknown, used or revoked."""

    grpc_code = "UNAUTHENTICATED"


class StaleError(GeofedError):
    """A delta's base version is too old or unknown; the client should pull again."""

    grpc_code = "FAILED_PRECONDITION"


class MismatchError(GeofedError):
    """A site and the parameter server are configured differently where they must agree (the paradigm)."""

    grpc_code = "FAILED_PRECONDITION"


class UnavailableError(GeofedError):
    """The parameter server could not be reached, or a port could not be bound."""

    grpc_code = "UNAVAILABLE"


class LimitError(GeofedError):
    """A limit of the parameter server is reached (sessions, streams a session or peer may hold, handler threads);
    `retry_after` (when set) is how long to wait before trying again."""

    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after: timedelta | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PermissionDeniedError(GeofedError):
    """The caller proved who it is, but may not do this (a site certificate used for another site's name)."""

    grpc_code = "PERMISSION_DENIED"


class LaunchError(GeofedError):
    """Submitting or supervising a site job failed."""


_BY_CODE: dict[str, type[GeofedError]] = {
    "INVALID_ARGUMENT": ProtocolError,
    "DATA_LOSS": CodecError,
    "UNAUTHENTICATED": AuthError,
    "FAILED_PRECONDITION": StaleError,
    "UNAVAILABLE": UnavailableError,
    "RESOURCE_EXHAUSTED": LimitError,
    "PERMISSION_DENIED": PermissionDeniedError,
}


def from_grpc_code(code_name: str, message: str) -> GeofedError:
    """Rebuild the family member that a gRPC status name stands for (client side)."""
    return _BY_CODE.get(code_name, GeofedError)(message)
