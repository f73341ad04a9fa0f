"""Reading config values: durations, checks whose errors name the field, dataclasses from plain mappings and back."""

from __future__ import annotations

import dataclasses
import re
import typing
from datetime import timedelta
from typing import Any

from geofed_hpc.errors import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: Any, name: str) -> timedelta:
    """Read `30`, `30s`, `5m`, `2h`, `250ms` or a timedelta; the error names the field."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a duration like 30s, 5m or 2h, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ConfigError(f"{name}: expected a duration like 30s, 5m or 2h, got {value!r}")
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2) or "s"]
    if seconds < 0:
        raise ConfigError(f"{name}: a duration cannot be negative, got {value!r}")
    return timedelta(seconds=seconds)


def check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {message}")


def one_of(value: str, choices: tuple[str, ...], name: str) -> None:
    check(value in choices, name, f"must be one of {', '.join(choices)}; got {value!r}")


def from_dict(cls: type, raw: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from a plain mapping; unknown keys and wrong types raise ConfigError."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]}; valid keys in {where}: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, name: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_dict(hint, value, name + ".")
    if hint is timedelta:
        return parse_duration(value, name)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    return value


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain, YAML/JSON-friendly dict of a config dataclass (durations as seconds strings)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif isinstance(value, timedelta):
            out[f.name] = f"{value.total_seconds():f}".rstrip("0").rstrip(".") + "s"  # never 2.592e+06s
        else:
            out[f.name] = value
    return out
