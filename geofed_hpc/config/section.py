"""Config sections as pydantic dataclasses: one ConfigError that names the dotted key; plain dicts in and out."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal, TypeVar

import pydantic
from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from typing_extensions import dataclass_transform

from geofed_hpc.config.fields import format_duration
from geofed_hpc.errors import ConfigError

T = TypeVar("T")
# Unknown keys are refused; a number given for a text field (site.account=1234) is taken as its text.
_CONFIG = ConfigDict(extra="forbid", coerce_numbers_to_str=True)
# Each section class and the key it sits under in RunConfig ("" for RunConfig itself).
_PREFIX: dict[type, str] = {}
_ADAPTERS: dict[type, TypeAdapter[Any]] = {}
# Keys that were renamed: the old name is refused naming the new one.
RENAMED = {"site.cpus_per_site": "site.cpus_per_task (it always was per task, i.e. per rank)"}
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "dataclass_type": "a mapping",
}


@dataclass_transform(field_specifiers=(dataclasses.field, pydantic.Field))
def section(prefix: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: a validated pydantic dataclass whose errors are one ConfigError naming `prefix.key`."""

    def build(cls: type[T]) -> type[T]:
        made = typing.cast("type[T]", pydantic.dataclasses.dataclass(cls, config=_CONFIG))
        init = made.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)
            except ValidationError as exc:
                raise config_error(exc, made) from None

        setattr(made, "__init__", __init__)  # noqa: B010 (mypy refuses assigning a method)
        _PREFIX[made] = prefix
        return made

    return build


def from_dict(cls: type[T], raw: Any) -> T:
    """Build section `cls` from a plain mapping (the composed config, a job's pickle); errors name the key."""
    try:
        return _adapter(cls).validate_python(raw)
    except ValidationError as exc:
        raise config_error(exc, cls) from None


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain, YAML/JSON-friendly dict of a section (durations as strings like `90s`); from_dict reads it back."""
    return _adapter(type(obj)).dump_python(obj, mode="json")


def _adapter(cls: type) -> TypeAdapter[Any]:
    if cls not in _ADAPTERS:
        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


def config_error(exc: ValidationError, cls: type) -> ConfigError:
    """The first error of `exc` as one line that names the key as the command line writes it (ps.port)."""
    error = exc.errors()[0]
    key, owner, info = _locate(cls, error["loc"])
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        if key in RENAMED:
            return ConfigError(f"{key}: renamed to {RENAMED[key]}; write that in your site file or override")
        where = key.rpartition(".")[0] or "the top level"
        fields = sorted(getattr(owner, "__pydantic_fields__", {}))
        close = difflib.get_close_matches(key.rpartition(".")[2], fields, n=1, cutoff=0.75)
        if close:  # a typo: the one key meant, not the whole list
            meant = f"{where}.{close[0]}" if where != "the top level" else close[0]
            leaf = _first_leaf(error["input"])
            return ConfigError(f"unknown key {key}{leaf}; did you mean {meant}{leaf}?")
        return ConfigError(
            f"unknown key {key}{_first_leaf(error['input'])}; valid keys in {where}: {', '.join(fields)}"
        )
    return ConfigError(f"{key or 'config'}: {_describe(error, info)}")


def _locate(cls: type, loc: Sequence[int | str]) -> tuple[str, type, FieldInfo | None]:
    """The dotted key that `loc` points at (down to a field, not into its items), its section, and the field."""
    prefix = _PREFIX.get(cls, "")
    names = [prefix] if prefix else []
    owner, info = cls, None
    for part in loc:
        if info is not None:
            if info.annotation not in _PREFIX:
                break  # inside a list or mapping value: the field is the key
            owner = typing.cast(type, info.annotation)
        if not isinstance(part, str):
            break
        names.append(part)
        info = getattr(owner, "__pydantic_fields__", {}).get(part)
        if info is None:
            break  # an unknown key
    return ".".join(names), owner, info


def _first_leaf(value: Any) -> str:
    """`.lr` for a misspelled section given as {lr: 1} (`trian.lr=1` names trian.lr, as typed)."""
    if isinstance(value, dict) and value:
        first = next(iter(value))
        return f".{first}{_first_leaf(value[first])}"
    return ""


def _describe(error: ErrorDetails, info: FieldInfo | None) -> str:
    kind, value, ctx = error["type"], error["input"], error.get("ctx", {})
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {value!r}"
    if kind == "literal_error":
        choices = _literal_choices(info.annotation) if info else ()
        listed = ", ".join(str(c) or '""' for c in choices) or ctx.get("expected", "")
        return f"must be one of {listed}; got {value!r}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"{_range(info, ctx)}, got {_show(value)}"
    if kind == "value_error":
        return str(ctx["error"])
    if kind == "too_short":
        least = ctx["min_length"]
        return f"must have at least {least} item{'' if least == 1 else 's'}, got {value!r}"
    message = error["msg"]
    return f"{message[:1].lower()}{message[1:]}, got {value!r}"


def _literal_choices(hint: Any) -> tuple[Any, ...]:
    """The choices of the Literal in `hint` (also inside list[...])."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    for arg in typing.get_args(hint):
        if found := _literal_choices(arg):
            return found
    return ()


def _range(info: FieldInfo | None, ctx: dict[str, Any]) -> str:
    """The field's whole allowed range (both bounds when it has two): `must be in 0..65535`, `in [0, 1)`."""
    bounds = dict(ctx)
    for item in info.metadata if info else []:
        bounds |= {k: getattr(item, k) for k in ("ge", "gt", "le", "lt") if getattr(item, k, None) is not None}
    low = next(((k, bounds[k]) for k in ("ge", "gt") if k in bounds), None)
    high = next(((k, bounds[k]) for k in ("le", "lt") if k in bounds), None)
    if low and high:
        if low[0] == "ge" and high[0] == "le":
            return f"must be in {_show(low[1])}..{_show(high[1])}"
        opening, closing = "[" if low[0] == "ge" else "(", "]" if high[0] == "le" else ")"
        return f"must be in {opening}{_show(low[1])}, {_show(high[1])}{closing}"
    if low:
        if low[0] == "ge":
            return "must be 0 or more" if low[1] == 0 else f"must be at least {_show(low[1])}"
        return "must be positive" if low[1] == 0 else f"must be more than {_show(low[1])}"
    assert high is not None
    return f"must be at most {_show(high[1])}" if high[0] == "le" else f"must be less than {_show(high[1])}"


def _show(value: Any) -> str:
    if isinstance(value, timedelta):
        return format_duration(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
