"""A RunConfig without Hydra: from a composed config file (`launch --cfg`), a mapping, dotted key=value overrides."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from geofed_hpc.config.run import RunConfig
from geofed_hpc.config.section import from_dict, to_dict
from geofed_hpc.errors import ConfigError


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a composed config file: YAML (what `geofed-hpc launch ... --cfg` prints) or JSON (what
    `launch script=` hands each site's job). ConfigError naming the file when it cannot be read as one."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        kind = path.suffix[1:] or "YAML"
        raise ConfigError(f"config file {path}: not valid {kind} ({str(exc).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: expected a mapping of sections (site:, ps:, train: ...)")
    return raw


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Set each `key.sub=value` of `overrides` in `raw` (in place, returned). Values read as YAML scalars do on the
    command line (`3`, `true`, `5s`, `[a, b]`). Group options (`site=osc`) need the config folders: compose those
    with `geofed-hpc launch site=osc --cfg > fed.yaml` and pass the file."""
    for text in overrides:
        key, sep, value = str(text).lstrip("+").partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {text!r}: expected key=value with a dotted key, e.g. ps.address=host:50051")
        try:
            parsed = yaml.safe_load(value) if value else ""
        except yaml.YAMLError:
            parsed = value
        node = raw
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(parents[: i + 1])} is a value, not a section")
            node = child
        node[leaf] = parsed
    return raw


def plain_config(
    source: RunConfig | Mapping[str, Any] | str | Path | None = None, overrides: Iterable[str] = ()
) -> RunConfig:
    """The typed config from `source` (a RunConfig, a plain mapping, a YAML/JSON file; None: the defaults) with
    `overrides` applied; every value is validated as the command line's are, and errors name the key."""
    if isinstance(source, RunConfig):
        raw = to_dict(source)
    elif isinstance(source, Mapping):
        raw = json.loads(json.dumps(source, default=str))  # a deep, plain copy
    elif source is not None:
        raw = read_config_file(source)
    else:
        raw = {}
    return from_dict(RunConfig, apply_overrides(raw, overrides))
