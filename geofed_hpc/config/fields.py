"""Field types the config sections share: durations, one-or-many lists, patterned strings, cross-field checks."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, PlainSerializer

from geofed_hpc.errors import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def to_timedelta(value: Any) -> timedelta:
    """Read `30`, `30s`, `5m`, `2h`, `250ms` or a timedelta; ValueError says what was expected."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool):
        raise ValueError(f"expected a duration like 30s, 5m or 2h, got {value!r}")
    elif isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ValueError(f"expected a duration like 30s, 5m or 2h, got {value!r}")
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2) or "s"]
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative, got {value!r}")
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def parse_duration(value: Any, name: str) -> timedelta:
    """`to_timedelta` for a value outside the config sections (a flag); the error names it."""
    try:
        return to_timedelta(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def format_duration(value: timedelta) -> str:
    """Seconds as a plain string that `to_timedelta` reads back: `90s`, `0.25s` (never `2.592e+06s`)."""
    return f"{value.total_seconds():f}".rstrip("0").rstrip(".") + "s"


# A timedelta written 30s / 5m / 2h / 250ms (a number is seconds); dumped to JSON as seconds, e.g. "90s".
Duration = Annotated[
    timedelta, BeforeValidator(to_timedelta), PlainSerializer(format_duration, return_type=str, when_used="json")
]


def _one_as_list(value: Any) -> Any:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return [value]
    return value


# On a list field: a single value is a one-element list (site.setup="module load cuda" is one line).
OneOrMany = BeforeValidator(_one_as_list)


def pattern(regex: str, message: str) -> AfterValidator:
    """A string check whose error reads `message` (with `{value!r}` filled in) instead of the regex."""
    compiled = re.compile(regex)

    def matches(value: str) -> str:
        if not compiled.fullmatch(value):
            raise ValueError(message.format(value=value))
        return value

    return AfterValidator(matches)


def choice(options: tuple[str, ...]) -> AfterValidator:
    """A string that must be one of `options`: a Literal for values that cross module and wire boundaries as
    plain strings (codec names), so that callers need not narrow their `str` first."""

    def chosen(value: str) -> str:
        if value not in options:
            listed = ", ".join(o or '""' for o in options)
            raise ValueError(f"must be one of {listed}; got {value!r}")
        return value

    return AfterValidator(chosen)


# A federation, site or sbatch file name: safe in paths, job names and W&B groups.
Name = Annotated[str, pattern(r"[A-Za-z0-9_.-]+", "use letters, digits, _ . -; got {value!r}")]
_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+):(?P<port>\d+)")


def split_host_port(value: str) -> tuple[str, int]:
    """(host, port) of `host:port` or `[ipv6]:port`; ValueError saying what is wrong (a port outside 1..65535)."""
    match = _HOST_PORT.fullmatch(value)
    if not match:
        raise ValueError(f"expected host:port (e.g. vm.example.org:50051, [2001:db8::1]:50051), got {value!r}")
    port = int(match.group("port"))
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} of {value!r} is out of range: a port is 1..65535")
    return match.group("host").strip("[]"), port


def _host_port(value: str) -> str:
    if value:
        split_host_port(value)
    return value


# host:port (a port in 1..65535), [ipv6]:port, or empty.
HostPort = Annotated[str, AfterValidator(_host_port)]


def _joined(value: Any) -> Any:
    return ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else value


def _host_ports(value: str) -> str:
    for part in value.split(",") if value else []:
        split_host_port(part)
    return value


# One host:port or several ([a:port, b:port], kept as "a:port,b:port": most code dials the first), or empty.
HostPorts = Annotated[str, BeforeValidator(_joined), AfterValidator(_host_ports)]


def check(cond: bool, name: str, message: str) -> None:
    """A check that spans fields (in a section's __post_init__): ConfigError naming `name` when `cond` fails."""
    if not cond:
        raise ConfigError(f"{name}: {message}")
