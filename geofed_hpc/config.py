"""Typed, validated configuration dataclasses built from the composed Hydra tree."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
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


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {message}")


def _one_of(value: str, choices: tuple[str, ...], name: str) -> None:
    _check(value in choices, name, f"must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class SiteConfig:
    """Where site jobs run: `local` processes through submitit, or a Slurm cluster."""

    name: str = "local"
    executor: str = "local"
    num_sites: int = 2
    embedded_ps: bool = True
    cpus_per_site: int = 1
    timeout: timedelta = timedelta(hours=1)
    token: str = ""

    def __post_init__(self) -> None:
        self.timeout = parse_duration(self.timeout, "site.timeout")
        _one_of(self.executor, ("local",), "site.executor")
        _check(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", self.name)), "site.name", "use letters, digits, _ . -")
        _check(1 <= self.num_sites <= 64, "site.num_sites", f"must be in 1..64, got {self.num_sites}")
        _check(self.cpus_per_site >= 1, "site.cpus_per_site", "must be at least 1")


@dataclass
class ModelConfig:
    """A decoder-only causal language model's shape."""

    name: str = "tiny"
    arch: str = "gpt2"
    vocab_size: int = 50257
    context: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        _one_of(self.arch, ("gpt2",), "model.arch")
        for key in ("vocab_size", "context", "d_model", "n_layers", "n_heads", "d_ff"):
            _check(getattr(self, key) >= 1, f"model.{key}", f"must be at least 1, got {getattr(self, key)}")
        _check(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            f"must be divisible by model.n_heads ({self.d_model} % {self.n_heads} != 0)",
        )
        _check(0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}")


@dataclass
class PSConfig:
    """The parameter server: where it listens, where clients dial, and how it aggregates."""

    host: str = "127.0.0.1"
    port: int = 0
    address: str = ""
    insecure: bool = True
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    enroll_token: str = ""
    aggregation: str = "sync"
    global_lr: float = 1.0
    round_timeout: timedelta = timedelta(minutes=2)
    max_staleness: int = 4
    state_dir: str = ""
    chunk_bytes: int = 1 << 20
    max_message_bytes: int = 64 << 20
    max_delta_bytes: int = 8 << 30
    connect_timeout: timedelta = timedelta(seconds=30)
    rpc_timeout: timedelta = timedelta(minutes=10)

    def __post_init__(self) -> None:
        self.round_timeout = parse_duration(self.round_timeout, "ps.round_timeout")
        self.connect_timeout = parse_duration(self.connect_timeout, "ps.connect_timeout")
        self.rpc_timeout = parse_duration(self.rpc_timeout, "ps.rpc_timeout")
        _check(0 <= self.port <= 65535, "ps.port", f"must be in 0..65535, got {self.port}")
        _one_of(self.aggregation, ("sync", "async"), "ps.aggregation")
        _check(self.global_lr > 0, "ps.global_lr", f"must be positive, got {self.global_lr}")
        _check(self.max_staleness >= 0, "ps.max_staleness", "must be 0 or more")
        _check(
            4096 <= self.chunk_bytes <= self.max_message_bytes // 2,
            "ps.chunk_bytes",
            f"must be in 4096..{self.max_message_bytes // 2} (half of ps.max_message_bytes)",
        )
        if self.address:
            _check(
                bool(re.fullmatch(r"[^\s:]+:\d{1,5}", self.address)),
                "ps.address",
                f"expected host:port, got {self.address!r}",
            )
        if not self.insecure:
            _check(
                bool(self.ca_file or self.cert_file),
                "ps.insecure",
                "TLS is on: set ps.ca_file (clients) and ps.cert_file/ps.key_file (server), "
                "or ps.insecure=true for a local plaintext demo",
            )

    def dial_address(self) -> str:
        """The host:port clients dial (ps.address, else host:port)."""
        return self.address or f"{self.host}:{self.port}"


@dataclass
class CodecConfig:
    """How deltas are compressed on the wire."""

    name: str = "int8"
    block_size: int = 1 << 16
    zstd_level: int = 1

    def __post_init__(self) -> None:
        _one_of(self.name, ("fp32", "int8"), "codec.name")
        _check(self.block_size >= 64, "codec.block_size", f"must be at least 64, got {self.block_size}")
        _check(1 <= self.zstd_level <= 22, "codec.zstd_level", f"must be in 1..22, got {self.zstd_level}")


@dataclass
class DataConfig:
    """Training text and tokenizer."""

    source: str = "bible"
    tokenizer: str = "gpt2"
    cache_dir: str = ""
    val_fraction: float = 0.02
    max_tokens: int = 0
    val_batches: int = 8

    def __post_init__(self) -> None:
        _one_of(self.tokenizer, ("gpt2",), "data.tokenizer")
        _check(0.0 < self.val_fraction < 0.5, "data.val_fraction", f"must be in (0, 0.5), got {self.val_fraction}")
        _check(self.max_tokens >= 0, "data.max_tokens", "must be 0 (all) or positive")
        _check(self.val_batches >= 1, "data.val_batches", "must be at least 1")
        if self.source != "bible":
            _check(
                Path(self.source).exists(),
                "data.source",
                f"{self.source!r} is neither 'bible' nor an existing .txt/.jsonl file",
            )


@dataclass
class TrainConfig:
    """Local training and the sync cadence (Algorithm 1: H local steps or T seconds)."""

    lr: float = 3e-3
    weight_decay: float = 0.0
    batch_size: int = 8
    sync_interval: timedelta = timedelta(seconds=30)
    max_local_steps: int = 0
    max_syncs: int = 0
    seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        self.sync_interval = parse_duration(self.sync_interval, "train.sync_interval")
        _check(self.lr > 0, "train.lr", f"must be positive, got {self.lr}")
        _check(self.batch_size >= 1, "train.batch_size", "must be at least 1")
        _check(
            self.sync_interval.total_seconds() > 0 or self.max_local_steps > 0,
            "train.sync_interval",
            "set a positive sync interval or train.max_local_steps",
        )
        _check(self.max_local_steps >= 0, "train.max_local_steps", "must be 0 (no cap) or positive")
        _check(self.max_syncs >= 0, "train.max_syncs", "must be 0 (until stopped) or positive")
        _check(self.threads >= 1, "train.threads", "must be at least 1")


@dataclass
class RunConfig:
    """Everything one `geofed-hpc` command needs."""

    federation: str = "geofed"
    run_dir: str = "runs/geofed"
    wandb_mode: str = "offline"
    verbosity: int = 0
    site: SiteConfig = field(default_factory=SiteConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        _one_of(self.wandb_mode, ("offline", "online", "disabled"), "wandb_mode")
        _check(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", self.federation)), "federation", "use letters, digits, _ . -")


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
            out[f.name] = f"{value.total_seconds():g}s"
        else:
            out[f.name] = value
    return out
